"""Several shards through one model load: a run over a range of `hidden_states` partitions (what a
UI backfill and `eagle3 run` launch) loads the target once, and each shard stays its own
partition: its own materialization and metadata, its own check, its own failure."""

import dataclasses

import polars as pl
import pytest
from dagster import AssetKey, DagsterInstance, RetryPolicy, materialize

from eagle3_assets.assets import hidden_states
from eagle3_assets.cli import history
from eagle3_assets.core.layout import Layout
from eagle3_assets.core.report import shard_history
from eagle3_assets.dagster_compat import RANGE_END_TAG, RANGE_START_TAG
from eagle3_assets.entrypoints.extract_hidden_states import LOAD_DELAY_ENV
from eagle3_assets.launchers import LocalLauncher
from eagle3_assets.pipeline import _ranges
from eagle3_assets.settings import Settings

from .test_extract_job import write_generations

SHARDS = [f"rows_{i * 4:05d}-{i * 4 + 4:05d}" for i in range(4)]
LOAD_S = 3.0  # stands in for a big target's load (Kimi-K2.5: 24.5 minutes)


def run_four_shards(tiny_target, tmp_path, bad: str | None = None):
    settings = Settings(target_model=str(tiny_target), storage_root=str(tmp_path / "data"),
                        extraction={"dtype": "float32", "device": "cpu", "batch_tokens": 64})
    layout = Layout(settings.root)
    layout.generations(SHARDS[0]).parent.mkdir(parents=True)
    for i, shard in enumerate(SHARDS):
        df = write_generations(layout.generations(shard), n=4, seed=20 + i)
        if shard == bad:  # token ids beyond the vocabulary: this shard's forward fails
            df.with_columns(pl.col("input_ids").list.eval(pl.element() + 10_000)).write_parquet(layout.generations(shard))
    instance = DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("shards", SHARDS)
    result = materialize([hidden_states.build(settings)], instance=instance, raise_on_error=False,
                         tags={RANGE_START_TAG: SHARDS[0], RANGE_END_TAG: SHARDS[-1]},
                         resources={"launcher": LocalLauncher(env={LOAD_DELAY_ENV: str(LOAD_S)})})
    return instance, result


def test_a_four_shard_run_loads_the_model_once_and_reports_each_shard(tiny_target, tmp_path):
    instance, result = run_four_shards(tiny_target, tmp_path)
    assert result.success
    loads = [e for e in instance.all_logs(result.run_id) if "model loaded in" in (e.user_message or "")]
    assert len(loads) == 1 and "for 4 shard(s)" in loads[0].user_message
    mats = {m.partition: {k: v.value for k, v in m.metadata.items()}
            for m in result.asset_materializations_for_node("hidden_states")}
    assert sorted(mats) == SHARDS and all(m["samples"] == 4 and m["shards_per_load"] == 4 for m in mats.values())
    assert len({m["tokens"] for m in mats.values()}) > 1, "each shard has its own metadata"
    checks = {e.partition: e.passed for e in result.get_asset_check_evaluations()}
    assert checks == {s: True for s in SHARDS}
    # `eagle3 history`: the shards' shares of the load add up to one load, not four.
    rows = shard_history(history(instance))
    assert len(rows) == 4 and rows["run_id"].n_unique() == 1
    assert LOAD_S <= rows["model_load_s"].sum() < 2 * LOAD_S
    assert rows["model_load_s"].max() < LOAD_S / 2


def test_one_failing_shard_leaves_the_other_three_materialized(tiny_target, tmp_path, monkeypatch):
    # the GPU retry policy without its pause
    no_delay = dataclasses.replace(hidden_states.SPEC, retry_policy=RetryPolicy(max_retries=1, delay=0))
    monkeypatch.setattr(hidden_states, "build", no_delay.build)
    instance, result = run_four_shards(tiny_target, tmp_path, bad=SHARDS[2])
    assert not result.success
    # The failed shard alone was retried, in a second job of the same run; the others ran once.
    loads = [e.user_message for e in instance.all_logs(result.run_id) if "model loaded in" in (e.user_message or "")]
    assert len(loads) == 2 and "for 4 shard(s)" in loads[0] and "for 1 shard(s)" in loads[1]
    assert instance.get_materialized_partitions(AssetKey("hidden_states")) == {SHARDS[0], SHARDS[1], SHARDS[3]}
    message = result.get_step_failure_events()[0].event_specific_data.error.cause.message
    assert "1 of 4 shard(s) failed" in message and f"{SHARDS[2]}: IndexError" in message
    checks = {e.partition: e.passed for e in result.get_asset_check_evaluations()}
    assert checks == {SHARDS[0]: True, SHARDS[1]: True, SHARDS[3]: True}
    mats = {m.partition: {k: v.value for k, v in m.metadata.items()}
            for m in result.asset_materializations_for_node("hidden_states")}
    # The three good shards carry the data-version tags an output's materialization gets.
    tags = [r.asset_materialization.tags for r in instance.fetch_materializations(AssetKey("hidden_states"), limit=10).records]
    assert all("dagster/data_version" in t and "dagster/input_data_version/generations" in t for t in tags)
    assert sorted(mats) == [SHARDS[0], SHARDS[1], SHARDS[3]] and all(m["shards_per_load"] == 4 for m in mats.values())


@pytest.mark.parametrize("wanted, ranges", [
    ({"a", "b", "c", "d"}, [["a", "b", "c", "d"]]),
    ({"a", "c", "d"}, [["a"], ["c", "d"]]),
    (set(), []),
])
def test_eagle3_run_groups_the_shards_to_extract_into_contiguous_ranges(wanted, ranges):
    assert _ranges(["a", "b", "c", "d"], wanted) == ranges
