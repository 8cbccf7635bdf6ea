"""End to end on the real SmolLM2-135M-Instruct: the whole graph, every shard, a fresh instance.

Uses the project's dagster.yaml as the instance config (copied into a temporary
project root), runs what `eagle3 run` runs, then reads the history back through
the `eagle3 history --json` command, as a user would.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from dagster import AssetKey, AssetRecordsFilter, DagsterInstance
from safetensors import safe_open

from eagle3_assets.cli import history, summary
from eagle3_assets.pipeline import run_pipeline
from eagle3_assets.core.export import validate_for_engine
from eagle3_assets.core.sample_files import MANIFEST
from eagle3_assets.core.target import resolve_target
from eagle3_assets.core.report import manifests_summary, plot_history, throughput_report
from eagle3_assets.definitions import build_definitions
from eagle3_assets.settings import load_settings

ROOT = Path(__file__).resolve().parents[1]

SETTINGS = {
    "target_model": "embedded:SmolLM2-135M-Instruct",
    "prompts_source": "embedded:sharegpt",
    "max_prompts": 9,
    "max_prompt_tokens": 128,
    "shard_size": 3,
    "storage_root": "data",
    "generation": {"batch_size": 3, "max_new_tokens": 12},
    "extraction": {"batch_tokens": 2048},
    "vocab": {"draft_vocab_size": 256},
    "training": {"epochs": 1, "batch_tokens": 512, "warmup_steps": 1, "ttt_steps": 7},
    "eval": {"num_prompts": 2, "max_new_tokens": 12, "num_draft_tokens": 7},
}


@pytest.mark.e2e
def test_whole_graph_on_smollm2(tmp_path, monkeypatch):
    torch.set_num_threads(os.cpu_count() or 1)  # tiny.py sets 1 for the unit tests
    project = tmp_path / "project"
    project.mkdir()
    for f in ("dagster.yaml", "workspace.yaml"):
        shutil.copy(ROOT / f, project / f)
    (project / "eagle3.yaml").write_text(yaml.safe_dump(SETTINGS))
    monkeypatch.chdir(project)
    monkeypatch.setenv("DAGSTER_HOME", str(project))
    settings = load_settings(project / "eagle3.yaml")
    defs = build_definitions(settings)
    instance = DagsterInstance.get()

    logs = []
    assert run_pipeline(defs, instance, settings, log=logs.append), "\n".join(logs)

    keys = instance.get_dynamic_partitions("shards")
    assert keys == ["rows_00000-00003", "rows_00003-00006", "rows_00006-00009"]
    rows = history(instance)
    by_asset = {}
    for r in rows:
        by_asset.setdefault(r["asset"], []).append(r)
    assert {a: len(v) for a, v in by_asset.items()} == {
        "prompts": 1, "generations": 3, "hidden_states": 3, "vocab_map": 1, "drafter": 1, "drafter_eval": 1
    }

    # Every shard's metadata agrees with its files on disk.
    for r in by_asset["hidden_states"]:
        m, shard = r["metadata"], Path(r["metadata"]["path"])
        files = [f for f in shard.iterdir() if f.is_file()]
        samples = [f for f in files if f.suffix == ".safetensors"]
        assert m["bytes_on_disk"] == sum(f.stat().st_size for f in files)
        assert m["samples"] == len(samples) == 3 and (shard / MANIFEST).is_file()
        assert m["tokens"] == sum(safe_open(str(f), "pt").get_slice("input_ids").get_shape()[0] for f in samples)
        assert m["tokens_per_s"] > 0 and m["model_load_s"] > 0 and m["processes"] == 1
        assert m["aux_layer_ids"] == [2, 15, 27] and m["dtype"] == "bfloat16"
        assert m["bytes_expected"] == m["tokens"] * (4 + 1 + 4 * 576 * 2)
    gens = {r["partition"]: r["metadata"] for r in by_asset["generations"]}
    hs = {r["partition"]: r["metadata"] for r in by_asset["hidden_states"]}
    assert all(gens[k]["tokens"] == hs[k]["tokens"] for k in keys)
    # The three shards' answers came from one run, one model load, as their hidden states did.
    assert len({r["run_id"] for r in by_asset["generations"]}) == 1
    assert all(gens[k]["shards_per_load"] == 3 and hs[k]["shards_per_load"] == 3 for k in keys)

    prompts = by_asset["prompts"][0]["metadata"]
    assert prompts["rows"] == 9 and prompts["shards"] == 3
    vocab = by_asset["vocab_map"][0]["metadata"]
    assert vocab["draft_vocab_size"] == 256 and 0 < vocab["token_coverage"] <= 1
    drafter = by_asset["drafter"][0]["metadata"]
    ckpt = Path(drafter["path"])
    assert (ckpt / "config.json").is_file() and (ckpt / "model.safetensors").is_file()
    assert len(drafter["per_step_accuracy"]) == 7 and drafter["steps"] >= 1
    for engine, key in (("vllm", "export_vllm"), ("sglang", "export_sglang"), ("vllm", "export_speculators")):
        assert validate_for_engine(drafter[key], engine, extracted_layer_ids=[2, 15, 27]) == []
    ev = by_asset["drafter_eval"][0]["metadata"]
    assert 1.0 <= ev["tau"] <= 8.0 and ev["prompts_used"] == 2 and ev["tau_mt-bench"] == ev["tau"]
    assert ev["greedy_check_matches"] == ev["greedy_check_prompts"] == 2  # float32: speculative == plain greedy
    # Batch 1 and batch 16 asked; 2 prompts: batch 2. Both sides' tokens/s and their ratio.
    assert ev["speedup_batches"] == [1, 2] and ev["engine"] == "batched"
    assert all(ev[f"spec_tok_s_b{b}"] > 0 and ev[f"greedy_tok_s_b{b}"] > 0 for b in (1, 2))
    assert any(line.startswith("acceptance length tau:") for line in summary(instance, keys).splitlines())

    # The model card beside the drafter and each export, from the figures the run recorded.
    card = (ckpt / "README.md").read_text()
    assert "| batch | prompts | plain greedy tok/s | speculative tok/s |" in card
    assert f"tau {ev['tau']:.3f}" in card and f"{sum(hs[k]['samples'] for k in keys):,} samples" in card
    assert "| embedded:sharegpt | 9 |" in card and f"{drafter['steps']:,} steps" in card
    assert "--speculative-draft-model-path ./sglang " in card and '"method": "eagle3"' in card
    assert "de-quantized from Q4_1 GGUF" in card and "HuggingFaceTB" not in card[card.index("## Serving"):]
    spec = json.loads((Path(drafter["export_speculators"]) / "config.json").read_text())
    converted = resolve_target(settings.target_model, settings.model_cache_dir)  # the Q4_1 GGUF, de-quantized
    assert spec["speculators_config"]["verifier"]["name_or_path"] == str(Path(converted).resolve())
    assert all((Path(drafter[k]) / "README.md").read_text() == card for k in ("export_vllm", "export_sglang", "export_speculators"))
    assert ev["model_card"] == card
    # The learning curve, one observation per logged point, for the UI's plots.
    points = instance.fetch_observations(AssetRecordsFilter(asset_key=AssetKey("drafter")), limit=1000).records
    curve = [{k: v.value for k, v in r.event_log_entry.asset_observation.metadata.items()}
             for r in sorted(points, key=lambda r: r.storage_id)]
    assert [int(p["curve_step"]) for p in curve] == [p["step"] for p in drafter["learning_curve"]]
    assert all(len([k for k in p if k.startswith("curve_top1_step_")]) == 7 and p["curve_loss"] > 0 for p in curve)

    # The throughput history as a table, a chart, and what the manifests say is on disk.
    report = throughput_report(rows)
    assert report["shard"].to_list() == keys and report["runs"].to_list() == [1, 1, 1]
    assert report["latest_tokens_per_s"].to_list() == [round(hs[k]["tokens_per_s"], 1) for k in keys]
    png = plot_history(rows, tmp_path / "history.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    on_disk = manifests_summary(settings.root / "hidden_states")
    assert [(s, n, t) for s, n, t, _ in on_disk] == [(k, 3, hs[k]["tokens"]) for k in keys]

    # Lineage: each materialization carries a data version derived from its inputs.
    for key in ("prompts", "drafter"):
        ev_ = instance.get_latest_materialization_event(AssetKey(key))
        assert ev_.asset_materialization.tags.get("dagster/data_version")

    # The CLI reads the same instance from the project root, without any exported variable.
    env = {k: v for k, v in os.environ.items() if k != "DAGSTER_HOME"}
    out = subprocess.run(
        [sys.executable, "-m", "eagle3_assets.cli", "history", "--json"], cwd=project, env=env,
        capture_output=True, text=True, check=True,
    )
    cli_rows = json.loads(out.stdout)
    assert [(r["asset"], r["partition"], r["run_id"]) for r in cli_rows] == [
        (r["asset"], r["partition"], r["run_id"]) for r in rows
    ]
    table = subprocess.run(
        [sys.executable, "-m", "eagle3_assets.cli", "history"], cwd=project, env=env,
        capture_output=True, text=True, check=True,
    ).stdout
    assert "hidden_states" in table and f"{len(rows)} materializations" in table
