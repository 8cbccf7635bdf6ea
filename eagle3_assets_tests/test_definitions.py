import dataclasses

from dagster import AssetKey

from eagle3_assets.definitions import build_definitions
from eagle3_assets.settings import Settings, load_settings

ASSETS = ["prompts", "generations", "hidden_states", "vocab_map", "drafter", "drafter_eval"]


def test_definitions_hold_the_six_assets_and_their_lineage():
    defs = build_definitions(load_settings())
    graph = defs.resolve_asset_graph()
    assert sorted(k.to_user_string() for k in graph.get_all_asset_keys()) == sorted(ASSETS)
    deps = {k.to_user_string(): sorted(p.to_user_string() for p in graph.get(k).parent_keys) for k in graph.get_all_asset_keys()}
    assert deps == {
        "prompts": [],
        "generations": ["prompts"],
        "hidden_states": ["generations"],
        "vocab_map": ["generations"],
        "drafter": ["hidden_states", "vocab_map"],
        "drafter_eval": ["drafter"],
    }
    for name in ("generations", "hidden_states"):
        assert graph.get(AssetKey(name)).partitions_def.name == "shards"
    for job in ("prompts_job", "shard_job", "extraction_job", "drafter_job"):
        defs.resolve_job_def(job)


def test_a_settings_change_changes_exactly_the_affected_code_versions():
    def versions(settings):
        graph = build_definitions(settings).resolve_asset_graph()
        return {k.to_user_string(): graph.get(k).code_version for k in graph.get_all_asset_keys()}

    base = Settings()
    same = versions(base)
    changed = versions(base.model_copy(update={"vocab": dataclasses.replace(base.vocab, draft_vocab_size=1000)}))
    assert {k for k in same if same[k] != changed[k]} == {"vocab_map", "drafter"}
    changed = versions(base.model_copy(update={"eval": dataclasses.replace(base.eval, workers=4)}))
    assert {k for k in same if same[k] != changed[k]} == {"drafter_eval"}


def test_assets_are_grouped_and_kinded_so_the_graph_reads_at_a_glance():
    graph = build_definitions(load_settings()).resolve_asset_graph()
    groups = {k.to_user_string(): graph.get(k).group_name for k in graph.get_all_asset_keys()}
    assert groups == {"prompts": "data", "generations": "data", "hidden_states": "features", "vocab_map": "features",
                      "drafter": "drafter", "drafter_eval": "drafter"}
    kinds = {k.to_user_string(): graph.get(k).kinds for k in graph.get_all_asset_keys()}
    assert kinds["hidden_states"] == {"pytorch", "safetensors"} and kinds["prompts"] == {"parquet"}
    assert all(kinds.values())


def test_the_graph_order_and_the_jobs_are_read_from_the_assets_deps():
    from eagle3_assets.definitions import asset_jobs, graph_order

    defs = build_definitions(load_settings())
    assert graph_order(defs) == ASSETS  # the shards' work first, then what reads every shard
    jobs = asset_jobs(defs)
    assert jobs == {"prompts": "prompts_job", "generations": "shard_job", "hidden_states": "extraction_job",
                    "vocab_map": "drafter_job", "drafter": "drafter_job", "drafter_eval": "drafter_job"}
    base = Settings()
    topk = build_definitions(base.model_copy(update={"extraction": dataclasses.replace(base.extraction, teacher="topk")}))
    # the top-k teacher's files are over the draft vocabulary: the vocab map comes before the extraction
    assert graph_order(topk) == ["prompts", "generations", "vocab_map", "hidden_states", "drafter", "drafter_eval"]
    assert asset_jobs(topk) == jobs


def test_importing_the_code_location_reads_no_settings(tmp_path):
    """The settings are an argument (`build_definitions(settings)`); `defs` reads the file only when
    Dagster loads the location, so an import names no file and fails on none."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "EAGLE3_SETTINGS": str(tmp_path / "missing.yaml"),
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    p = subprocess.run([sys.executable, "-c", "import eagle3_assets.definitions as d; assert not hasattr(d, 'SETTINGS')"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
