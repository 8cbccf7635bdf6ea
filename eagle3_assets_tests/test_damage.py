"""Damage is noticed: each sample file carries a checksum written with it, the manifest holds sizes
and checksums; a rerun re-extracts only the missing or resized files; `verify_checksums` reads
every file; training names a file it cannot read; the free-space check adds up every shard."""

from __future__ import annotations

import json
import shutil
from collections import namedtuple

import polars as pl
import pytest
from safetensors import safe_open

from eagle3_assets.core.extract_job import ExtractShards, extract_layout, extract_shards, run_extraction
from eagle3_assets.core.sample_files import (
    MANIFEST,
    DamagedSampleError,
    damaged_files,
    read_sample_slices,
    shard_damage,
    verify_checksums,
)
from eagle3_assets.core.train import TrainConfig, TrainJob, train_drafter

from .test_extract_job import params, write_generations
from .test_train_job import job, setup


def extracted(tiny_target, tmp_path, log=None):
    p = params(tiny_target, tmp_path)
    run_extraction(p, log=log or (lambda m: None))
    return tmp_path / "shard"


def test_each_sample_file_carries_a_checksum_the_manifest_holds_and_verify_reads(tiny_target, tmp_path):
    shard = extracted(tiny_target, tmp_path)
    manifest = pl.read_parquet(shard / MANIFEST)
    assert manifest.columns == ["row_id", "file", "tokens", "bytes", "checksum"]
    for file, size, checksum in manifest.select("file", "bytes", "checksum").iter_rows():
        with safe_open(str(shard / file), framework="pt") as f:
            assert f.metadata()["checksum"] == checksum and checksum.startswith("crc32:")
        assert (shard / file).stat().st_size == size
    assert verify_checksums(shard) == [] and damaged_files(shard) == [] and shard_damage(shard) is None

    files = manifest["file"].to_list()
    garbled = bytearray((shard / files[0]).read_bytes())
    garbled[-3] ^= 0x40  # one bit of the data: same size, finite values, valid header
    (shard / files[0]).write_bytes(bytes(garbled))
    assert damaged_files(shard) == []  # the cheap check sees sizes only
    bad = dict(verify_checksums(shard))
    assert list(bad) == [files[0]] and "does not match the crc32:" in bad[files[0]]

    (shard / files[1]).write_bytes((shard / files[1]).read_bytes()[:100])  # truncated
    (shard / files[2]).unlink()
    assert dict(damaged_files(shard)) == {files[1]: f"100 bytes, the manifest recorded {manifest['bytes'][1]:,}",
                                          files[2]: "missing"}
    assert "2 sample file(s) missing or resized since its manifest" in shard_damage(shard)
    assert set(dict(verify_checksums(shard))) == set(files[:3])


def test_a_rerun_re_extracts_only_the_missing_or_resized_files(tiny_target, tmp_path):
    shard = extracted(tiny_target, tmp_path)
    files = sorted(p.name for p in shard.glob("*.safetensors"))
    before = {f: (shard / f).read_bytes() for f in files}
    resized = shard / files[1]
    resized.write_bytes(before[files[1]] + b"\0" * 16)  # grown: its header still parses
    (shard / files[3]).unlink()
    lines = []
    meta = run_extraction(params(tiny_target, tmp_path), log=lines.append)
    assert meta["samples_resumed"] == len(files) - 2 and meta["samples"] == len(files)
    assert any(f"2 missing or resized since its manifest: {files[1]}, {files[3]}" in line for line in lines), lines
    assert {f: (shard / f).read_bytes() for f in files} == before and verify_checksums(shard) == []


def test_training_names_the_file_it_cannot_read_and_the_job_removes_it(tiny_target, tmp_path):
    params_ = setup(tiny_target, tmp_path)
    shard = tmp_path / "shard"
    victim = sorted(shard.glob("*.safetensors"))[5]
    victim.write_bytes(victim.read_bytes()[:50])  # "incomplete metadata" in safetensors' words
    with pytest.raises(DamagedSampleError, match=f"sample file {victim} cannot be read"):
        read_sample_slices(victim)
    cfg = TrainConfig(max_steps=5, batch_tokens=128, warmup_steps=1, ttt_steps=2, preload=True)
    with pytest.raises(DamagedSampleError, match=str(victim)):
        train_drafter(TrainJob(**params_, config=cfg), log=lambda m: None)
    first = sorted(shard.glob("*.safetensors"))[0]  # the one whose header the resumable state's fingerprint reads
    saved = first.read_bytes()
    first.write_bytes(b"\0" * len(saved))
    with pytest.raises(DamagedSampleError, match=str(first)):
        train_drafter(TrainJob(**params_, config=cfg, state_path=str(tmp_path / "state.pt")), log=lambda m: None)
    first.write_bytes(saved)

    # Through the job: it names the file and removes it, so `eagle3 run` sees the shard damaged.
    p = job(params_, cfg)
    out, _ = p.communicate(timeout=300)
    assert p.returncode != 0
    assert f"sample file {victim} cannot be read" in out and f"its shard {shard.name} is stale" in out, out[-3000:]
    assert not victim.exists()
    if (shard / MANIFEST).exists():
        assert shard_damage(shard).startswith("1 sample file(s) missing")


def test_the_free_space_check_adds_up_every_shard_of_the_run(tiny_target, tmp_path, monkeypatch):
    jobs, needed = [], []
    for i in range(3):
        gens = tmp_path / f"g{i}.parquet"
        df = write_generations(gens, n=5, seed=i)
        jobs.append(params(tiny_target, tmp_path, generations_path=str(gens), shard_dir=str(tmp_path / f"shard{i}")))
        needed.append(extract_layout(jobs[-1].config, 64).predict_bytes(int(df["input_ids"].list.len().sum()), 5))
    # Room for any one shard (even two), not for the three.
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 0, sum(needed) - 1))
    results = {}
    extract_shards(ExtractShards(jobs), lambda m: None, lambda j, r: results.__setitem__(j.shard_dir, r))
    assert len(results) == 3
    for r in results.values():
        assert isinstance(r, OSError) and "the 3 shards of this run (shard0, shard1, shard2) need about" in str(r)
    assert not [f for i in range(3) for f in (tmp_path / f"shard{i}").glob("*.safetensors")]  # refused before writing


def test_eagle3_verify_reads_every_file_and_deletes_the_damaged_ones(tiny_target, tmp_path, monkeypatch, capsys):
    from eagle3_assets.cli import main

    from .test_pipeline_runs import ROOT

    project = tmp_path / "project"
    project.mkdir()
    for f in ("dagster.yaml", "workspace.yaml"):
        shutil.copy(ROOT / f, project / f)
    (project / "eagle3.yaml").write_text(json.dumps({"target_model": str(tiny_target), "storage_root": "data"}))
    shard = project / "data" / "hidden_states" / "rows_00000-00005"
    run_extraction(params(tiny_target, tmp_path, shard_dir=str(shard)), log=lambda m: None)
    monkeypatch.chdir(project)
    monkeypatch.setenv("DAGSTER_HOME", str(project))
    monkeypatch.delenv("EAGLE3_SETTINGS", raising=False)
    assert main(["verify"]) == 0 and "rows_00000-00005: ok" in capsys.readouterr().out
    victim = sorted(shard.glob("*.safetensors"))[2]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1
    victim.write_bytes(bytes(data))
    assert main(["verify"]) == 1
    out = capsys.readouterr().out
    assert f"rows_00000-00005: 1 damaged\n  {victim.name}: data checksum" in out and victim.exists()
    assert main(["verify", "--delete"]) == 1 and not victim.exists()
    assert shard_damage(shard).startswith("1 sample file(s) missing")


def test_eagle3_run_plans_a_shard_with_missing_or_resized_files_again(tiny_target, tmp_path):
    """The planner of `eagle3 run`: a materialized shard whose files no longer match its manifest's
    sizes runs again, and says which files (one stat each; nothing is read)."""
    from dagster import AssetMaterialization, DagsterInstance

    from eagle3_assets.definitions import build_definitions
    from eagle3_assets.pipeline import Planner, Unit
    from eagle3_assets.settings import Settings

    settings = Settings(target_model=str(tiny_target), storage_root=str(tmp_path / "data"))
    key = "rows_00000-00005"
    shard = settings.root / "hidden_states" / key
    run_extraction(params(tiny_target, tmp_path, shard_dir=str(shard)), log=lambda m: None)
    instance = DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("shards", [key])
    instance.report_runless_asset_event(AssetMaterialization("hidden_states", partition=key))
    planner = Planner(build_definitions(settings), instance, settings, force=False)
    unit = Unit("hidden_states", key)
    assert not (planner.reason(unit) or "").startswith("damaged")
    files = sorted(p.name for p in shard.glob("*.safetensors"))
    (shard / files[0]).unlink()
    (shard / files[4]).write_bytes((shard / files[4]).read_bytes()[:-8])
    reason = planner.reason(unit)
    assert reason.startswith(f"damaged: 2 sample file(s) missing or resized since its manifest: {files[0]} missing; "
                             f"{files[4]} "), reason
