"""Generation over a range of shards in one launcher job (one model load), as extraction does: `eagle3 run`
launches one `generate-answers` job per contiguous range of shards to answer, a shard whose prompt rows are
unchanged is kept inside the range, and a shard that fails leaves the others materialized."""

from __future__ import annotations

import dataclasses
import json
import sys

import polars as pl

from dagster import AssetKey, DagsterInstance, RetryPolicy, materialize

from eagle3_assets.assets import generations, prompts
from eagle3_assets.dagster_compat import RANGE_END_TAG, RANGE_START_TAG
from eagle3_assets.definitions import build_definitions
from eagle3_assets.launchers import LocalLauncher
from eagle3_assets.pipeline import run_pipeline
from eagle3_assets.records import latest_metadata
from eagle3_assets.settings import Settings

SHARDS = ["rows_00000-00003", "rows_00003-00006", "rows_00006-00009"]
LAUNCHED: list = []  # the GPU jobs the counting launcher ran, in this process


class CountingLauncher(LocalLauncher):
    """The local launcher, recording each job it launches."""

    def run(self, context, job):
        LAUNCHED.append(job)
        return super().run(context, job)


def settings_for(tiny_target, tmp_path, n: int = 9) -> Settings:
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"prompt": f"question {i}: " + "more " * (i % 3)}) + "\n" for i in range(n)))
    return Settings(target_model=str(tiny_target), prompts_source=str(source), shard_size=3,
                    storage_root=str(tmp_path / "data"),
                    generation={"batch_size": 4, "max_new_tokens": 4, "dtype": "float32", "device": "cpu"})


def generation_metadata(instance, shard: str) -> dict:
    return latest_metadata(instance, AssetKey("generations"), shard)


def test_eagle3_run_answers_a_range_of_shards_in_one_job_and_keeps_unchanged_shards(tiny_target, tmp_path):
    settings = settings_for(tiny_target, tmp_path)
    defs = build_definitions(settings, launcher=CountingLauncher())
    LAUNCHED.clear()
    logs: list[str] = []
    with DagsterInstance.ephemeral() as instance:
        assert run_pipeline(defs, instance, settings, select=["prompts", "generations"], log=logs.append), logs
        # One run, one job, one model load for the three shards.
        assert [r.job_name for r in instance.get_runs()].count("shard_job") == 1
        assert [(j.name, [s.shard for s in j.params.jobs], j.labels) for j in LAUNCHED] == [
            ("generate-answers", SHARDS, {"eagle3.dev/shard": f"{SHARDS[0]}..{SHARDS[-1]}"})]
        run = next(r for r in instance.get_runs() if r.job_name == "shard_job")
        loads = [e.user_message for e in instance.all_logs(run.run_id) if "loaded in" in (e.user_message or "")]
        assert len(loads) == 1 and "for 3 shard(s)" in loads[0], loads
        first = {s: generation_metadata(instance, s) for s in SHARDS}
        for s, m in first.items():  # each shard its own figures, the asset's keys beside the job's
            assert m["samples"] == 3 and m["prompts"] == 3 and m["reused"] is False and m["shards_per_load"] == 3
            assert m["tokens"] > 0 and m["tokens_per_s"] > 0 and m["engine"] == "transformers"
            assert m["path"] == str(settings.root / "generations" / f"{s}.parquet") and len(m["rows_sha256"]) == 64
            assert abs(m["model_load_s"] * 3 - m["model_load_total_s"]) < 0.01
        assert (settings.root / "generations" / f"{SHARDS[1]}.parquet").is_file()

        # Appended prompts: a fourth shard; the three old ones run in the same range (their prompts
        # input changed) but are kept, not regenerated: the job answers the new shard alone.
        settings = settings_for(tiny_target, tmp_path, n=10)
        defs = build_definitions(settings, launcher=CountingLauncher())
        LAUNCHED.clear()
        assert run_pipeline(defs, instance, settings, select=["prompts", "generations"], log=logs.append), logs
        assert [[s.shard for s in j.params.jobs] for j in LAUNCHED] == [["rows_00009-00010"]]
        assert [r.job_name for r in instance.get_runs()].count("shard_job") == 2
        for s in SHARDS:
            m = generation_metadata(instance, s)
            assert m["reused"] is True and "tokens_per_s" not in m
            assert (m["samples"], m["tokens"], m["rows_sha256"]) == (3, first[s]["tokens"], first[s]["rows_sha256"])
        assert generation_metadata(instance, "rows_00009-00010")["reused"] is False

        # --force answers every shard again, still in one job.
        LAUNCHED.clear()
        assert run_pipeline(defs, instance, settings, force=True, select=["generations"], log=logs.append), logs
        assert [[s.shard for s in j.params.jobs] for j in LAUNCHED] == [[*SHARDS, "rows_00009-00010"]]
        assert all(generation_metadata(instance, s)["reused"] is False for s in SHARDS)


def test_one_failing_shard_leaves_the_others_of_the_range_materialized(tiny_target, tmp_path, monkeypatch):
    settings = settings_for(tiny_target, tmp_path)
    instance = DagsterInstance.ephemeral()
    assert materialize([prompts.build(settings)], instance=instance).success
    # Its output path is a folder: writing this shard's answers fails, inside the job, after the load.
    (settings.root / "generations" / f"{SHARDS[1]}.parquet").mkdir(parents=True)
    no_delay = dataclasses.replace(generations.SPEC, retry_policy=RetryPolicy(max_retries=1, delay=0))
    LAUNCHED.clear()
    result = materialize([no_delay.build(settings)], instance=instance, raise_on_error=False,
                         tags={RANGE_START_TAG: SHARDS[0], RANGE_END_TAG: SHARDS[-1]},
                         resources={"launcher": CountingLauncher()})
    assert not result.success
    # The failed shard alone was retried, in a second job of the same run; the others ran once.
    assert [[s.shard for s in j.params.jobs] for j in LAUNCHED] == [SHARDS, [SHARDS[1]]]
    assert instance.get_materialized_partitions(AssetKey("generations")) == {SHARDS[0], SHARDS[2]}
    message = result.get_step_failure_events()[0].event_specific_data.error.cause.message
    assert "1 of 3 shard(s) failed" in message and f"{SHARDS[1]}: " in message
    records = instance.fetch_materializations(AssetKey("generations"), limit=10).records
    mats = {r.partition_key: {k: v.value for k, v in r.asset_materialization.metadata.items()} for r in records}
    assert sorted(mats) == [SHARDS[0], SHARDS[2]] and all(m["samples"] == 3 and not m["reused"] for m in mats.values())
    # They carry the data-version tags an output's materialization gets.
    tags = [r.asset_materialization.tags for r in records]
    assert all("dagster/data_version" in t and "dagster/input_data_version/prompts" in t for t in tags)


# The job process, killed (os._exit: no clean-up, no exit handler) right after it reported its first shard.
DIE_AFTER_FIRST_SHARD = """
import os, runpy
from eagle3_assets.core import engines
real = engines.generate_shards
def dying(group, log, report):
    def report_then_die(job, result):
        report(job, result)
        os._exit(9)
    real(group, log, report_then_die)
engines.generate_shards = dying
runpy.run_module("eagle3_assets.entrypoints.generate_answers", run_name="__main__")
"""


class DyingLauncher(CountingLauncher):
    @staticmethod
    def command(job):
        return [sys.executable, "-c", DIE_AFTER_FIRST_SHARD]


def test_a_job_killed_after_a_shard_keeps_that_shard(tiny_target, tmp_path):
    """The job dies (killed, out of memory) after it reported a shard: that shard's answers are kept
    and materialized, only the others fail, and the retry starts after it."""
    settings = settings_for(tiny_target, tmp_path)
    instance = DagsterInstance.ephemeral()
    assert materialize([prompts.build(settings)], instance=instance).success
    one_retry = dataclasses.replace(generations.SPEC, retry_policy=RetryPolicy(max_retries=1, delay=0))
    LAUNCHED.clear()
    result = materialize([one_retry.build(settings)], instance=instance, raise_on_error=False,
                         tags={RANGE_START_TAG: SHARDS[0], RANGE_END_TAG: SHARDS[-1]},
                         resources={"launcher": DyingLauncher()})
    assert not result.success
    # Each job answered one shard and died; the retry asked only for the shards not yet done.
    assert [[s.shard for s in j.params.jobs] for j in LAUNCHED] == [SHARDS, SHARDS[1:]]
    assert instance.get_materialized_partitions(AssetKey("generations")) == {SHARDS[0], SHARDS[1]}
    for shard in SHARDS[:2]:
        assert pl.read_parquet(settings.root / "generations" / f"{shard}.parquet").height == 3
        assert generation_metadata(instance, shard)["samples"] == 3
    message = result.get_step_failure_events()[0].event_specific_data.error.cause.message
    assert "1 of 3 shard(s) failed" in message and "job failed before this shard was done" in message


def test_generate_shards_loads_once_and_reports_each_shard_or_its_error(tiny_target, tmp_path):
    from eagle3_assets.core.config import from_json
    from eagle3_assets.core.engines import EngineRun, GenerateJob, GenerateShards, generate_shards
    from eagle3_assets.core.generate import GenerationConfig

    prompts_path = tmp_path / "prompts.parquet"
    pl.DataFrame({"row_id": list(range(6)), "system": [None] * 6, "prompt": [f"q{i}" for i in range(6)]}).write_parquet(
        prompts_path)
    gen = GenerationConfig(dtype="float32", device="cpu", batch_size=3, max_new_tokens=3)
    jobs = [GenerateJob(str(prompts_path), s, s + 2, str(tmp_path / f"rows_{s:05d}-{s + 2:05d}.parquet"),
                        str(tiny_target), gen) for s in (0, 2, 4)]
    (tmp_path / jobs[1].out_path).mkdir()  # this shard cannot be written
    group = GenerateShards(jobs)
    assert GenerateShards.from_json(json.dumps(dataclasses.asdict(group))) == group == from_json(
        GenerateShards, json.dumps(dataclasses.asdict(group)))
    logs, reported = [], []
    generate_shards(group, logs.append, lambda job, result: reported.append((job.shard, result)))
    assert sum("loaded in" in line for line in logs) == 1
    assert [s for s, _ in reported] == ["rows_00000-00002", "rows_00002-00004", "rows_00004-00006"]
    ok = [r for _, r in reported if isinstance(r, EngineRun)]
    assert len(ok) == 2 and isinstance(reported[1][1], IsADirectoryError)
    for run in ok:
        m = run.metadata()
        assert m["samples"] == 2 and m["shards_per_load"] == 3 and m["engine"] == "transformers"
        assert {"tokens", "prompt_tokens", "answer_tokens", "tokens_per_s", "generate_s", "model_load_s"} <= set(m)
    assert pl.read_parquet(jobs[2].out_path)["row_id"].to_list() == [4, 5]
