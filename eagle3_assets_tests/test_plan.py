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
from eagle3_assets.core.plan import ShardTokens, format_plan, make_plan, measured_rate, shard_tokens
from eagle3_assets.core.sample_files import HEADER_BYTES_PER_FILE, SampleLayout

ROOT = Path(__file__).resolve().parents[1]

# The system we replace, as it ran on Kimi-K2.5: hidden 7,168, 3 aux layers, 5 shards of
# 2,000 samples, 21,033,536 tokens; 3,161 tok/s and a 24.5-minute model load, 111 min of extraction.
KIMI_HIDDEN, KIMI_SAMPLES, KIMI_TOKENS = 7168, 10_000, 21_033_536


def kimi_shards() -> list[ShardTokens]:
    per = [4_206_707] * 4 + [KIMI_TOKENS - 4 * 4_206_707]
    return [ShardTokens(f"rows_{i * 2000:05d}-{(i + 1) * 2000:05d}", 2000, t, "generations") for i, t in enumerate(per)]


def test_plan_on_the_kimi_figures_is_the_file_contract_arithmetic(tmp_path, capsys):
    layout = SampleLayout(KIMI_HIDDEN, torch.bfloat16)  # bf16, last_hidden: what the old system stored
    plan = make_plan(kimi_shards(), layout, tmp_path / "hidden_states", None)  # no rate: time unknown, not guessed
    assert plan["total"]["time_s"] is None and "unknown" in format_plan(plan)
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

    plan = plan_from_settings(settings, [])  # no prompts table yet: the one these settings build
    assert [s["shard"] for s in plan["shards"]] == ["rows_00000-00048", "rows_00048-00096", "rows_00096-00144"]
    assert plan["layout"]["bytes_per_token"] == 4 + 1 + 8 * 576 == 4613  # SmolLM2: hidden 576
    assert all(s["source"] == "prompt_lengths" for s in plan["shards"]) and "these settings build" in plan["prompts_table"]
    cap = settings.max_prompt_tokens + settings.generation.max_new_tokens
    assert all(48 * settings.generation.max_new_tokens < s["tokens"] < 48 * cap for s in plan["shards"])
    assert plan["total"]["bytes"] == plan["total"]["tokens"] * 4613 + 144 * HEADER_BYTES_PER_FILE
    assert plan["fits"] and plan["free_bytes"] > 0 and plan["rate_source"].startswith("unknown")

    # --quick: the table not tokenized, each prompt at the cap: a looser bound
    quick = plan_from_settings(settings, [], quick=True)
    per_sample = settings.max_prompt_tokens + settings.generation.max_new_tokens
    assert all(s["source"] == "prompt_count" and s["tokens"] == 48 * per_sample for s in quick["shards"])
    assert "not tokenized" in quick["prompts_table"] and quick["total"]["tokens"] > plan["total"]["tokens"]
    # every turn and a sampled answer per prompt: twice the samples, and the later turns counted
    more = settings.model_copy(update={"generation": dataclasses.replace(settings.generation, turns="all",
                                                                         samples_per_prompt=1)})
    more_plan = plan_from_settings(more, [])
    assert sum(s["samples"] for s in more_plan["shards"]) == 288
    assert more_plan["total"]["tokens"] > 2 * plan["total"]["tokens"]  # the demo's prompts have later turns

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
                "metadata": {"tokens_per_s": 1000.0, "model_load_s": 2.0, "device": "cpu"}}]
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
    plan = make_plan(shard_tokens(paths, 5, 8, None), extract_layout(job.config, 64), paths.root / "hidden_states", None)
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
    assert "fp8/last_hidden" in table and "rows_00010-00020" in table and "lower bound" not in table


def kimi_k2_config():
    """Kimi-K2's text model (its config.json; Kimi-K2.5's text model has the same shape): DeepSeek-V3's
    architecture, 61 layers, hidden 7,168, 384 routed experts of which 8 per token, one shared."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(vocab_size=163840, hidden_size=KIMI_HIDDEN, intermediate_size=18432, moe_intermediate_size=2048,
                            num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64, n_shared_experts=1,
                            n_routed_experts=384, routed_scaling_factor=2.827, kv_lora_rank=512, q_lora_rank=1536,
                            qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=1, topk_group=1,
                            num_experts_per_tok=8, first_k_dense_replace=1, norm_topk_prob=True,
                            max_position_embeddings=262144, rms_norm_eps=1e-5, tie_word_embeddings=False)


def test_gpu_plan_for_kimi_k25_int4_on_8_h200(capsys):
    """The reference run on paper: Kimi-K2.5 in INT4 (Kimi's compressed-tensors experts, the rest bf16)
    over 8 H200s, experts split 48 per GPU, everything else on each."""
    from eagle3_assets.core.plan import MEASURED_MOE, active_params, format_gpu_plan, gpu_plan, measured_moe_config
    from eagle3_assets.core.quantized import Int4Group, predict_checkpoint_bytes
    from eagle3_assets.core.sample_files import STORAGES, TEACHERS

    kimi = kimi_k2_config()
    int4 = predict_checkpoint_bytes(kimi, Int4Group(32))
    bf16 = predict_checkpoint_bytes(kimi, None)
    # INT4 experts: 0.5 B per weight + a bf16 scale per 32 = 0.5625 B; about 0.6 TB against about 2 TB in bf16.
    assert int4["routed_experts"] == 60 * 384 * 3 * (7168 * 2048 * 9 // 16 + 8)
    assert round(int4["total"] / 1e9, 1) == 594.2 and round(bf16["total"] / 1e9, 1) == 2052.8
    layouts = [SampleLayout(KIMI_HIDDEN, torch.bfloat16, s, t, 64) for s in STORAGES for t in TEACHERS]
    g = gpu_plan(kimi, int4, 8, layouts, KIMI_TOKENS / KIMI_SAMPLES)
    assert g["weights"]["experts_per_gpu"] == 48
    assert round(g["weights_bytes"] / 1e9, 2) == 92.44  # 71.35 experts + 18.75 attention, dense and shared + 2.35 embeddings
    assert round(g["dequant_staging_bytes"] / 1e9, 2) == 4.23  # 48 experts' gate, up and down in bf16
    assert g["activation_bytes_per_token"]["total"] == 594_432
    assert g["pack_tokens"] == 50_176  # (0.9 x 141 GB - 92.44 - 4.23) / 594,432 B, in whole 1,024s
    assert round(g["host_staging_bytes"]["bf16/last_hidden"] / 1e9, 1) == 8.6
    # The rate: the measured one-GPU DeepSeek-V3-shape rate, scaled by the active parameters per token one GPU
    # runs (2.51B of the measured shape, the benchmark's 3.18B less its embeddings and head). Kimi-K2 has 30.51B,
    # 21.14B of them routed experts; the extraction's expert parallel runs every token through the other 9.37B on
    # every GPU and through an eighth of the routed ones: 9.37 + 21.14 / 8 = 12.02B.
    ref = measured_moe_config()
    assert round((active_params(ref)["total"] + 2 * 163840 * 2048) / 1e9, 2) == 3.18
    parts = active_params(kimi)
    assert round(parts["total"] / 1e9, 2) == 30.51 and round(parts["routed_experts"] / 1e9, 2) == 21.14
    assert round(g["active_params_per_gpu"] / 1e9, 2) == 12.02
    assert round(g["forward_tokens_per_s"]) == 15_674 and round(g["files_tokens_per_s"]) == 15_184
    assert MEASURED_MOE["forward_tokens_per_s"] == 75_007 and "BENCHMARKS.md" in g["rate_source"]
    by = {lay["layout"]: lay for lay in g["layouts"]}
    assert round(by["bf16/last_hidden"]["bytes_per_sample"] / 1e6, 1) == 120.6  # the reference run: 83 MB/sample
    assert round(by["fp8/topk64"]["bytes_per_sample"] / 1e6, 1) == 45.8
    assert round(by["bf16/last_hidden"]["disk_ceiling_tokens_per_s"]) == 22_668
    assert round(by["fp8/topk64"]["tokens_per_s"]) == 15_184  # with files: 4.8x the reference run's 3,161 tok/s
    with capsys.disabled():
        print("\n" + format_gpu_plan(g))


def test_the_measured_shape_is_the_benchmarks():
    import importlib.util

    spec = importlib.util.spec_from_file_location("extract_throughput", ROOT / "benchmarks" / "extract_throughput.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from eagle3_assets.core.plan import MEASURED_MOE, measured_moe_config

    assert bench.moe_config(MEASURED_MOE["arch"], tiny=False).to_dict() == measured_moe_config().to_dict()


# ---------------------------------------------------------------------------------------------
# Issue 22, item 8: the plan is of what the settings will build, on the instance `eagle3 run` uses.


def _project(tmp_path, tiny_target, **overrides):
    from eagle3_assets.settings import Settings

    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"question {i} " + "more " * i}) + "\n" for i in range(12)))
    return Settings(target_model=str(tiny_target), prompts_source=str(src), storage_root=str(tmp_path / "data"),
                    shard_size=2, max_prompt_tokens=4096, decontaminate=False,
                    generation={"max_new_tokens": 8}, eval={"prompt_sets": [str(src)], "num_prompts": 2}, **overrides)


def _report_extracted(instance, settings, shard: str) -> None:
    """Record the prompts, a shard's generations and hidden states as `eagle3 run` would have, with
    these settings' code versions and lineage, and leave the shard's manifest on disk."""
    from dagster import AssetKey, AssetMaterialization

    from eagle3_assets.definitions import build_definitions

    graph = build_definitions(settings).resolve_asset_graph()
    up = {"generations": "prompts", "hidden_states": "generations"}
    for asset, partition in (("generations", shard), ("hidden_states", shard)):
        key = AssetKey(up[asset])
        pointer = instance.fetch_materializations(key, limit=1).records[0].storage_id
        instance.report_runless_asset_event(AssetMaterialization(asset, partition=partition, tags={
            "dagster/code_version": graph.get(AssetKey(asset)).code_version, "dagster/data_version": f"v-{asset}",
            f"dagster/input_data_version/{up[asset]}": f"v-{up[asset]}",
            f"dagster/input_event_pointer/{up[asset]}": str(pointer)}))
    paths = Layout(settings.root)
    paths.hidden_states(shard).mkdir(parents=True)
    for name in ("a", "b"):  # the files the manifest lists, of its sizes (a missing one is damage)
        (paths.hidden_states(shard) / name).write_bytes(b"x")
    pl.DataFrame({"row_id": [0, 1], "file": ["a", "b"], "tokens": [10, 10], "bytes": [1, 1]}).write_parquet(
        paths.hidden_states(shard) / "manifest.parquet")


def test_plan_reads_no_prompts_table_built_with_other_settings(tiny_target, tmp_path):
    from dagster import DagsterInstance, materialize

    from eagle3_assets.assets import prompts
    from eagle3_assets.cli import plan_from_settings

    small = _project(tmp_path, tiny_target, max_prompts=4)  # the demo of the issue: 144 of 13,974 prompts
    with DagsterInstance.ephemeral() as instance:
        assert materialize([prompts.build(small)], instance=instance).success
        assert len(plan_from_settings(small, [], instance=instance)["shards"]) == 2  # its own table: kept
        everything = small.model_copy(update={"max_prompts": None})
        plan = plan_from_settings(everything, [], instance=instance)
    assert [s["samples"] for s in plan["shards"]] == [2] * 6  # the 12 prompts these settings build, not 4
    assert "the table these settings build (12 prompts; the run rebuilds it: the prompt file or its settings changed)" \
        == plan["prompts_table"]


def test_plan_counts_a_stale_shard_whole_after_a_storage_change(tiny_target, tmp_path):
    from dagster import DagsterInstance, materialize

    from eagle3_assets.assets import prompts
    from eagle3_assets.cli import plan_from_settings

    bf16 = _project(tmp_path, tiny_target, max_prompts=4)
    with DagsterInstance.ephemeral() as instance:
        assert materialize([prompts.build(bf16)], instance=instance).success
        _report_extracted(instance, bf16, "rows_00000-00002")
        same = plan_from_settings(bf16, [], instance=instance)
        fp8 = bf16.model_copy(update={"extraction": dataclasses.replace(bf16.extraction, storage="fp8")})
        changed = plan_from_settings(fp8, [], instance=instance)
    assert [s["complete"] for s in same["shards"]] == [True, False], [s.get("redo") for s in same["shards"]]
    first = changed["shards"][0]
    assert not first["complete"] and "new code version" in first["redo"]
    assert changed["total"]["bytes_to_write"] == changed["total"]["bytes"]  # every byte, the stale shard's too
    text = format_plan(changed)
    assert "rows_00000-00002 is extracted again: stale: hidden_states[rows_00000-00002] has a new code version" in text


def test_plan_times_every_stage_from_the_same_kind_of_device_or_says_unknown(tiny_target, tmp_path):
    from eagle3_assets.cli import plan_from_settings

    settings = _project(tmp_path, tiny_target, max_prompts=4,
                        training={"max_steps": 10, "batch_tokens": 100, "time_budget_s": 50.0})
    gpu_only = [{"asset": a, "partition": p, "timestamp": "2026-12-01T00:00:00", "run_id": "g", "metadata": m} for a, p, m in (
        ("generations", "rows_00000-00002", {"tokens_per_s": 5000.0, "model_load_s": 3.0, "device": "cuda"}),
        ("hidden_states", "rows_00000-00002", {"tokens_per_s": 319_000.0, "model_load_s": 1.0, "device": "cuda"}),
        ("drafter", None, {"tokens_per_s": 90_000.0, "device": "cuda:0"}),
        ("drafter_eval", None, {"eval_s": 30.0, "prompts_used": 80, "device": "cuda"}))]
    plan = plan_from_settings(settings, gpu_only)  # this machine has no GPU: none of that says how long it takes here
    assert [(st["stage"], st["time_s"]) for st in plan["stages"]] == [
        ("generations", None), ("hidden_states", None), ("drafter", None), ("drafter_eval", None)]
    assert plan["total"]["time_s"] is None and plan["total"]["run_time_s"] is None
    text = format_plan(plan)
    assert "unknown: no generations materialization on cpu in the history" in text and " 0 s" not in text
    assert "lower bound" not in text

    cpu = [{**r, "timestamp": "2026-12-02T00:00:00", "metadata": {**r["metadata"], "device": "cpu"}} for r in gpu_only]
    plan = plan_from_settings(settings, gpu_only + cpu)
    stages = {st["stage"]: st for st in plan["stages"]}
    tokens = plan["total"]["tokens"]
    assert stages["generations"]["time_s"] == pytest.approx(4 * 8 / 5000 + 2 * 3.0)  # 4 samples x max_new_tokens
    assert stages["hidden_states"]["time_s"] == pytest.approx(tokens / 319_000 + 2 * 1.0)
    assert stages["drafter"]["time_s"] == pytest.approx(10 * 100 / 90_000)  # max_steps x batch_tokens
    assert stages["drafter_eval"]["time_s"] == pytest.approx(30.0 * 2 / 80)  # scaled to num_prompts
    assert plan["total"]["run_time_s"] == pytest.approx(sum(st["time_s"] for st in stages.values()))
    assert "on cpu" in plan["rate_source"]
