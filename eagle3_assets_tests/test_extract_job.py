"""The extraction job as one shard's process runs it: files, manifest, resume, disk space."""

import os

import polars as pl
import pytest

from eagle3_assets_tests.tiny import extract_job
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from eagle3_assets.core.extract_job import run_extraction
from eagle3_assets.core.sample_files import DiskSpaceError, MANIFEST, read_sample, sample_file
from eagle3_assets.core.target import TargetModelError


def write_generations(path, n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for r in range(n):
        t = int(torch.randint(3, 40, (1,), generator=g))
        ids = torch.randint(5, 256, (t,), generator=g).tolist()
        p = max(1, t // 3)
        rows.append({"row_id": 100 + r, "input_ids": ids, "loss_mask": [0] * p + [1] * (t - p)})
    df = pl.DataFrame(rows, schema={"row_id": pl.Int64, "input_ids": pl.List(pl.Int32), "loss_mask": pl.List(pl.UInt8)})
    df.write_parquet(path)
    return df


def params(tiny_target, tmp_path, **kw):
    gens = tmp_path / "gens.parquet"
    if not gens.exists():
        write_generations(gens)
    base = dict(generations_path=str(gens), shard_dir=str(tmp_path / "shard"), model_dir=str(tiny_target),
                target_name="tiny", dtype="float32", device="cpu", batch_tokens=64, writer_threads=2,
                progress_every_s=0.05)
    base.update(kw)
    return extract_job(**base)


def test_shard_files_match_hugging_face_hidden_states(tiny_target, tmp_path):
    p = params(tiny_target, tmp_path, aux_layer_ids=[0, 3, 6])
    logs = []
    m = run_extraction(p, log=logs.append)
    gens = pl.read_parquet(p.generations_path)
    ref = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    for row in gens.iter_rows(named=True):
        s = read_sample(sample_file(tmp_path / "shard", row["row_id"]))
        with torch.no_grad():
            out = ref(torch.tensor([row["input_ids"]]), output_hidden_states=True)
        aux = torch.cat([out.hidden_states[j][0] for j in (0, 3, 6)], -1)
        torch.testing.assert_close(s["aux_hidden_states"], aux, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(s["last_hidden_state"], out.hidden_states[-1][0], rtol=1e-4, atol=1e-5)
        assert s["input_ids"].tolist() == row["input_ids"] and s["loss_mask"].tolist() == row["loss_mask"]
    files = sorted((tmp_path / "shard").iterdir())
    assert m["bytes_on_disk"] == sum(f.stat().st_size for f in files)
    assert m["samples"] == len(gens) == len([f for f in files if f.suffix == ".safetensors"])
    assert m["tokens"] == int(gens["input_ids"].list.len().sum())
    assert 0 < m["bytes_on_disk"] - m["bytes_expected"] < 2048 * len(files)  # headers + manifest only
    assert any("samples" in line and "bytes on disk" in line for line in logs)
    manifest = pl.read_parquet(tmp_path / "shard" / MANIFEST)
    assert manifest["bytes"].to_list() == [sample_file(tmp_path / "shard", r).stat().st_size for r in manifest["row_id"]]
    with safe_open(str(sample_file(tmp_path / "shard", 100)), "pt") as f:
        assert f.metadata()["aux_layer_ids"] == "0,3,6" and f.metadata()["target_model"] == "tiny"


def test_rerun_resumes_valid_files_and_redoes_corrupt_ones(tiny_target, tmp_path):
    p = params(tiny_target, tmp_path)
    run_extraction(p, log=lambda m: None)
    shard = tmp_path / "shard"
    good = sample_file(shard, 100).read_bytes()
    sample_file(shard, 101).write_bytes(good[: len(good) // 2])  # truncated, as by a crash
    sample_file(shard, 102).unlink()
    (shard / ".0000103.safetensors.999.tmp").write_bytes(b"partial")
    (shard / MANIFEST).unlink()
    m = run_extraction(p, log=lambda m: None)
    assert m["samples_resumed"] == 3 and m["samples"] == 5
    assert not list(shard.glob(".*"))
    assert (shard / MANIFEST).is_file()
    assert m["bytes_on_disk"] == sum(f.stat().st_size for f in shard.iterdir())


def test_disk_too_small_is_refused_before_writing_with_both_numbers(tiny_target, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(DiskSpaceError, match=r"needs about [\d,]+ bytes .* has 1,000 bytes"):
        run_extraction(params(tiny_target, tmp_path), log=lambda m: None)
    assert not list((tmp_path / "shard").glob("*.safetensors"))


def test_wrong_layer_id_names_the_valid_range(tiny_target, tmp_path):
    with pytest.raises(TargetModelError, match=r"\[99\] out of range for a 6-layer target \(valid: 0..6"):
        run_extraction(params(tiny_target, tmp_path, aux_layer_ids=[1, 2, 99]), log=lambda m: None)


def test_missing_model_is_named(tmp_path):
    from eagle3_assets.core.target import resolve_target

    with pytest.raises(TargetModelError, match="target model /no/model does not exist"):
        resolve_target("/no/model")
    (tmp_path / "m").mkdir()
    with pytest.raises(TargetModelError, match="not a Hugging Face model folder"):
        resolve_target(str(tmp_path / "m"))
    assert os.path.isdir(tmp_path)
