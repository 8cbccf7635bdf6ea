"""`eagle3 plan`: bytes, tokens, free space and time before anything runs, on the Kimi-K2.5 figures
and on the embedded demo; its byte prediction is the one the extraction's disk preflight checks."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import polars as pl
import pytest
import torch

from eagle3_assets.core.layout import Layout
from eagle3_assets.core.plan import ShardTokens, ceiling_rate, format_plan, make_plan, measured_rate, shard_tokens
from eagle3_assets.core.sample_files import HEADER_BYTES_PER_FILE, SampleLayout

ROOT = Path(__file__).resolve().parents[1]

# The system we replace on Kimi-K2.5 (REFERENCE.md): hidden 7,168, 3 aux layers, 5 shards of
# 2,000 samples, 21,033,536 tokens; 3,161 tok/s and a 24.5-minute model load, 111 min of extraction.
KIMI_HIDDEN, KIMI_SAMPLES, KIMI_TOKENS = 7168, 10_000, 21_033_536


def kimi_shards() -> list[ShardTokens]:
    per = [4_206_707] * 4 + [KIMI_TOKENS - 4 * 4_206_707]
    return [ShardTokens(f"rows_{i * 2000:05d}-{(i + 1) * 2000:05d}", 2000, t, "generations") for i, t in enumerate(per)]


def test_plan_on_the_kimi_figures_is_the_file_contract_arithmetic(tmp_path, capsys):
    layout = SampleLayout(KIMI_HIDDEN, torch.bfloat16)  # bf16, last_hidden: what the old system stored
    plan = make_plan(kimi_shards(), layout, tmp_path / "hidden_states", ceiling_rate(layout))
    tensor_bytes = KIMI_TOKENS * (4 + 1 + 4 * KIMI_HIDDEN * 2)  # ids + mask + (3 aux + 1 last) x H x bf16
    assert tensor_bytes == 1_206_252_256_064  # 1.206 TB (the old system: 764 GB by du, 237.8 GB in its log)
    assert plan["total"]["tensor_bytes"] == tensor_bytes
    assert plan["total"]["bytes"] == tensor_bytes + KIMI_SAMPLES * HEADER_BYTES_PER_FILE
    assert (plan["total"]["samples"], plan["total"]["tokens"]) == (KIMI_SAMPLES, KIMI_TOKENS)
    alternatives = {a["layout"]: a for a in plan["alternatives"]}
    assert alternatives["fp8/last_hidden"]["bytes_per_token"] == 4 + 1 + 4 * KIMI_HIDDEN + 4 * 4  # 28,693
    assert alternatives["fp8/topk64"]["bytes_per_token"] == 4 + 1 + 3 * KIMI_HIDDEN + 3 * 4 + 64 * 4 + 1  # 21,778
    assert alternatives["fp8/topk64"]["share_of_bf16_last_hidden"] < 0.40  # the bar for topk
    assert alternatives["fp8/last_hidden"]["share_of_bf16_last_hidden"] < 0.55  # and for fp8

    # With the old system's measured rate and model load in the history, the time is its 111 minutes
    # of extraction plus one load per shard (each shard's job loads the target today).
    history = [{"asset": "hidden_states", "partition": "rows_00000-02000", "timestamp": "2026-11-01T00:00:00",
                "run_id": "r", "metadata": {"tokens_per_s": 3161.0, "model_load_s": 1470.0}}]
    rate = measured_rate(history, layout)
    plan = make_plan(kimi_shards(), layout, tmp_path / "hidden_states", rate)
    assert plan["total"]["time_s"] == pytest.approx(KIMI_TOKENS / 3161 + 5 * 1470)
    assert KIMI_TOKENS / 3161 / 60 == pytest.approx(111, abs=0.5)
    with capsys.disabled():
        print("\n" + format_plan(plan))


def test_measured_rate_prefers_the_same_layout_and_says_when_it_is_another():
    layout = SampleLayout(64, storage="fp8")
    rows = [
        {"asset": "hidden_states", "partition": "a", "timestamp": "2026-12-01T00:00:00", "run_id": "1",
         "metadata": {"tokens_per_s": 100.0, "storage": "fp8", "teacher": "last_hidden"}},
        {"asset": "hidden_states", "partition": "b", "timestamp": "2026-12-02T00:00:00", "run_id": "2",
         "metadata": {"tokens_per_s": 200.0}},  # older files: bf16/last_hidden
        {"asset": "generations", "partition": "b", "timestamp": "2026-12-03T00:00:00", "run_id": "3",
         "metadata": {"tokens_per_s": 999.0}},
    ]
    assert measured_rate(rows, layout).tokens_per_s == 100.0
    other = measured_rate(rows[1:], layout)
    assert other.tokens_per_s == 200.0 and "layout bf16/last_hidden (none measured in fp8/last_hidden)" in other.source
    assert measured_rate([], layout) is None


def test_plan_on_the_demo_uses_the_best_token_source_there_is(tmp_path):
    from eagle3_assets.cli import plan_from_settings
    from eagle3_assets.settings import load_settings

    settings = load_settings().model_copy(update={"storage_root": str(tmp_path / "data")})  # the embedded demo
    paths = Layout(settings.root)

    plan = plan_from_settings(settings, [])  # no prompts table yet: from the prompt count
    assert [s["shard"] for s in plan["shards"]] == ["rows_00000-00048", "rows_00048-00096", "rows_00096-00144"]
    assert plan["layout"]["bytes_per_token"] == 4 + 1 + 8 * 576 == 4613  # SmolLM2: hidden 576
    per_sample = settings.max_prompt_tokens + settings.generation.max_new_tokens
    assert all(s["source"] == "prompt_count" and s["tokens"] == 48 * per_sample for s in plan["shards"])
    assert plan["total"]["bytes"] == 144 * per_sample * 4613 + 144 * HEADER_BYTES_PER_FILE
    assert plan["fits"] and plan["free_bytes"] > 0 and "disk ceiling" in plan["rate_source"]

    from eagle3_assets.core.prompts import read_prompts

    paths.prompts.parent.mkdir(parents=True)
    read_prompts(settings.prompts_source, settings.max_prompts).rows.write_parquet(paths.prompts)
    shard0 = "rows_00000-00048"
    paths.generations(shard0).parent.mkdir(parents=True)
    pl.DataFrame({"row_id": list(range(48)), "input_ids": [[1] * (10 + i) for i in range(48)]}).write_parquet(
        paths.generations(shard0))
    fp8_topk = settings.model_copy(update={"extraction": dataclasses.replace(settings.extraction, storage="fp8",
                                                                             teacher="topk", topk=32)})
    history = [{"asset": "hidden_states", "partition": shard0, "timestamp": "2026-12-03T00:00:00", "run_id": "r",
                "metadata": {"tokens_per_s": 1000.0, "model_load_s": 2.0}}]
    plan = plan_from_settings(fp8_topk, history)
    by_shard = {s["shard"]: s for s in plan["shards"]}
    assert by_shard[shard0]["source"] == "generations" and by_shard[shard0]["tokens"] == sum(10 + i for i in range(48))
    assert {by_shard[k]["source"] for k in ("rows_00048-00096", "rows_00096-00144")} == {"prompt_lengths"}
    templated = by_shard["rows_00048-00096"]["tokens"] - 48 * settings.generation.max_new_tokens
    assert 48 < templated != 48 * settings.max_prompt_tokens  # real templated lengths, not the cap
    bpt = 4 + 1 + 3 * 576 + 3 * 4 + 32 * 4 + 1
    assert plan["layout"]["bytes_per_token"] == bpt == 1874
    assert by_shard[shard0]["bytes"] == by_shard[shard0]["tokens"] * bpt + 48 * HEADER_BYTES_PER_FILE
    assert by_shard[shard0]["time_s"] == pytest.approx(2.0 + by_shard[shard0]["tokens"] / 1000.0)
    text = format_plan(plan)
    assert "fp8/topk32" in text and "generations" in text and "prompt_lengths" in text and "fits" in text


def test_the_disk_preflight_checks_the_plans_bytes(tiny_target, tmp_path, monkeypatch):
    """The extraction job refuses a shard by the same prediction `eagle3 plan` prints for it."""
    from eagle3_assets.core import extract_job as extract_job_module
    from eagle3_assets.core.extract_job import extract_layout, run_extraction
    from eagle3_assets.core.sample_files import DiskSpaceError

    from .test_extract_job import write_generations
    from .tiny import extract_job

    paths, shard = Layout(tmp_path), "rows_00000-00005"
    paths.prompts.parent.mkdir(parents=True)
    pl.DataFrame({"row_id": list(range(5)), "system": [None] * 5, "prompt": ["p"] * 5}).write_parquet(paths.prompts)
    paths.generations(shard).parent.mkdir(parents=True)
    gens = write_generations(paths.generations(shard), n=5)
    gens.with_columns(pl.col("row_id") - 100).write_parquet(paths.generations(shard))
    job = extract_job(generations_path=str(paths.generations(shard)), shard_dir=str(paths.hidden_states(shard)),
                      model_dir=str(tiny_target), target_name="tiny", dtype="bfloat16", device="cpu", storage="fp8")
    plan = make_plan(shard_tokens(paths, 5, 8, 8, None, None), extract_layout(job.config, 64),
                     paths.root / "hidden_states", ceiling_rate(SampleLayout(64)))
    asked = []

    def refuse(shard_dir, needed, shards=None):
        asked.append(needed)
        raise DiskSpaceError("refused")

    monkeypatch.setattr(extract_job_module, "check_free_space", refuse)
    with pytest.raises(DiskSpaceError):
        run_extraction(job, log=lambda m: None)
    assert asked == [plan["shards"][0]["bytes"]] and plan["shards"][0]["source"] == "generations"


def test_eagle3_plan_command_prints_json_and_a_table(tmp_path, monkeypatch, capsys):
    from eagle3_assets.cli import main

    project = tmp_path / "project"
    project.mkdir()
    for f in ("dagster.yaml", "workspace.yaml"):
        shutil.copy(ROOT / f, project / f)
    (project / "eagle3.yaml").write_text("max_prompts: 20\nshard_size: 10\nextraction: {storage: fp8}\n")
    monkeypatch.chdir(project)  # as a user runs it: from the project folder, nothing exported
    monkeypatch.setenv("DAGSTER_HOME", str(project))
    monkeypatch.delenv("EAGLE3_SETTINGS", raising=False)
    assert main(["plan", "--json", "--tokens-per-s", "5000"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["layout"]["name"] == "fp8/last_hidden" and plan["layout"]["bytes_per_token"] == 21 + 4 * 576
    assert [s["samples"] for s in plan["shards"]] == [10, 10] and plan["rate_source"].startswith("given")
    assert plan["total"]["time_s"] == pytest.approx(plan["total"]["tokens"] / 5000)
    assert main(["plan"]) == 0
    table = capsys.readouterr().out
    assert "fp8/last_hidden" in table and "rows_00010-00020" in table and "disk ceiling" in table
