"""`eagle3 run` as a user runs it: what is missing or stale runs, a killed run continues, a second
run does nothing, and `eagle3 ui` started beside `eagle3 run` on a fresh project works.

Each `eagle3 run` is a real subprocess of the CLI on a temporary project (the repo's dagster.yaml
and workspace.yaml, a tiny random Llama target on the CPU, 2 shards of 4 prompts)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from dagster import AssetKey, AssetRecordsFilter, DagsterInstance, DagsterRunStatus, RunsFilter

ROOT = Path(__file__).resolve().parents[1]
SHARDS = ["rows_00000-00004", "rows_00004-00008"]
UNITS = ["prompts", *(f"{a}[{s}]" for s in SHARDS for a in ("generations", "hidden_states")),
         "vocab_map", "drafter", "drafter_eval"]


def make_project(root: Path, target: Path, **overrides) -> Path:
    root.mkdir(parents=True)
    for f in ("dagster.yaml", "workspace.yaml"):
        shutil.copy(ROOT / f, root / f)
    with open(root / "prompts.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"question {i}: " + "tell me more " * (i % 3 + 1)}) + "\n")
    with open(root / "evalset.jsonl", "w") as f:
        for i in range(2):
            f.write(json.dumps({"prompt": f"held out {i}", "category": "c"}) + "\n")
    settings = {
        "target_model": str(target),
        "prompts_source": "prompts.jsonl",
        "shard_size": 4,
        "storage_root": "data",
        "generation": {"batch_size": 4, "max_new_tokens": 8, "dtype": "float32"},
        "extraction": {"dtype": "float32", "batch_tokens": 64},
        "vocab": {"draft_vocab_size": 64},
        "training": {"max_steps": 300, "batch_tokens": 128, "warmup_steps": 1, "ttt_steps": 2, "save_every": 5},
        "eval": {"prompt_sets": ["evalset.jsonl"], "max_new_tokens": 8, "num_draft_tokens": 2,
                 "speedup_prompts": 1, "greedy_check_prompts": 1},
        **overrides,
    }
    (root / "eagle3.yaml").write_text(yaml.safe_dump(settings))
    return root


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "eagle3_assets.cli", *args]


def env() -> dict:
    # The CLI finds the project from its folder; nothing is exported by the user.
    return {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME", "EAGLE3_SETTINGS")} | {
        "OMP_NUM_THREADS": "1"}


def eagle3_run(project: Path, *args: str, timeout: float = 600) -> str:
    p = subprocess.run(cli("run", *args), cwd=project, env=env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    return p.stdout


@contextmanager
def instance_of(project: Path):
    """The project's instance (dagster.yaml's storage paths are relative to the project root)."""
    cwd = os.getcwd()
    os.chdir(project)
    try:
        with DagsterInstance.from_config(str(project)) as instance:
            yield instance
    finally:
        os.chdir(cwd)


def materializations(project: Path) -> dict[str, int]:
    """How many times each asset (and shard) was materialized in the project's instance."""
    with instance_of(project) as instance:
        counts = {}
        for key in instance.get_asset_keys():
            for r in instance.fetch_materializations(AssetRecordsFilter(asset_key=key), limit=1000).records:
                unit = key.to_user_string() + (f"[{r.partition_key}]" if r.partition_key else "")
                counts[unit] = counts.get(unit, 0) + 1
        return counts


def latest(project: Path, asset: str) -> dict:
    with instance_of(project) as instance:
        rec = instance.get_latest_materialization_event(AssetKey(asset))
        return {k: v.value for k, v in rec.asset_materialization.metadata.items()}


def kill_when(project: Path, condition, log: Path, timeout: float = 300) -> bool:
    """Start `eagle3 run`, SIGKILL its whole process group (the CLI and its job processes) once
    `condition(project, output so far)` holds; True if it was killed, False if it finished first."""
    with open(log, "w") as out:
        p = subprocess.Popen(cli("run"), cwd=project, env=env(), stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)
        deadline = time.time() + timeout
        while p.poll() is None and time.time() < deadline:
            if condition(project, log.read_text()):
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                return True
            time.sleep(0.01)
        assert p.poll() is not None, "eagle3 run did not finish"
        return False


def shard_dir(project: Path, i: int) -> Path:
    return project / "data" / "hidden_states" / SHARDS[i]


KILL_POINTS = {
    "prompts": lambda p, out: "-> prompts:" in out,
    "generations": lambda p, out: (p / "data" / "generations" / f"{SHARDS[0]}.parquet").is_file(),
    "hidden_states": lambda p, out: any(shard_dir(p, 1).glob("*.safetensors")),
    "vocab_map": lambda p, out: "-> vocab_map:" in out,
    "drafter": lambda p, out: (p / "data" / "drafter_state" / "train_state.pt").is_file(),
    "drafter_eval": lambda p, out: "drafter_eval - eval:" in out,
}


def test_a_kill_at_each_stage_then_eagle3_run_finishes_with_nothing_complete_redone(tiny_target, tmp_path):
    project = make_project(tmp_path / "project", tiny_target)
    killed = {}
    for stage, condition in KILL_POINTS.items():
        killed[stage] = kill_when(project, condition, tmp_path / f"run-killed-at-{stage}.log")
    assert sum(killed.values()) >= 5, killed  # (a fast stage may finish before its kill lands)
    out = eagle3_run(project)
    logs = out + "".join((tmp_path / f"run-killed-at-{s}.log").read_text() for s in KILL_POINTS)
    assert "was left unfinished by process" in logs and "marked failed" in logs

    # The graph is complete, and every asset and shard was materialized exactly once: what a
    # killed run had finished was kept, what it had not finished was done by a later run.
    assert materializations(project) == {u: 1 for u in UNITS}
    assert latest(project, "drafter")["resumed_from_step"] >= 5  # training continued from its saved state
    assert not (project / "data" / "drafter_state" / "train_state.pt").exists()  # dropped once recorded
    assert latest(project, "drafter_eval")["tau"] >= 1.0
    with instance_of(project) as instance:
        unfinished = instance.get_runs(RunsFilter(statuses=[DagsterRunStatus.STARTED, DagsterRunStatus.STARTING]))
        assert not unfinished, "a killed run was left 'started'"

    # A second run on the unchanged project does no model work: no run, no materialization.
    with instance_of(project) as instance:
        runs_before = len(instance.get_runs())
    out = eagle3_run(project)
    assert "nothing to do" in out and "up to date, skipped: prompts, generations[rows_00000-00004]" in out
    with instance_of(project) as instance:
        assert len(instance.get_runs()) == runs_before
    assert materializations(project) == {u: 1 for u in UNITS}


def test_stale_assets_rerun_and_select_and_force_choose_what_runs(tiny_target, tmp_path):
    project = make_project(tmp_path / "project", tiny_target, training={"max_steps": 3, "batch_tokens": 128,
                                                                          "warmup_steps": 1, "ttt_steps": 2})
    eagle3_run(project)
    # The shards' hidden states were extracted in one run, with one model load shared by both.
    with instance_of(project) as instance:
        recs = [instance.fetch_materializations(AssetRecordsFilter(asset_key=AssetKey("hidden_states"),
                                                                   asset_partitions=[s]), limit=1).records[0] for s in SHARDS]
    assert recs[0].run_id == recs[1].run_id
    assert [r.asset_materialization.metadata["shards_per_load"].value for r in recs] == [2, 2]
    # A setting read only by the evaluation: only drafter_eval is stale.
    settings = yaml.safe_load((project / "eagle3.yaml").read_text())
    settings["eval"]["num_draft_tokens"] = 3
    (project / "eagle3.yaml").write_text(yaml.safe_dump(settings))
    out = eagle3_run(project)
    assert "-> drafter_eval: stale: drafter_eval has a new code version" in out
    assert sum(line.startswith("-> ") for line in out.splitlines()) == 1
    # Both drafters compared, in drafter_eval's metadata and by `eagle3 report` (issue 20 item 4).
    ev = latest(project, "drafter_eval")
    assert ev["samples"] == 8 and ev["train_steps"] == 3 and ev["turns"] == "first" and ev["storage"] == "bf16"
    assert ev["settings"]["eval.num_draft_tokens"] == 3 and ev["settings"]["training.max_steps"] == 3
    assert ev["sources"] == [{"source": str(project / "prompts.jsonl"), "rows": 8}] and ev["data_s"] > 0
    assert "| 2 | eval.num_draft_tokens: 2 -> 3 |" in ev["comparison"]
    report = subprocess.run(cli("report"), cwd=project, env=env(), capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr[-2000:]
    assert "2  eval.num_draft_tokens: 2 -> 3" in report.stdout and "1  (first)" in report.stdout
    # Appended prompts: a new shard; the old shards' answers are kept (their rows are unchanged).
    with open(project / "prompts.jsonl", "a") as f:
        f.write(json.dumps({"prompt": "one more question"}) + "\n")
    out = eagle3_run(project, "--select", "prompts,generations")
    assert "-> prompts: the prompt file or its settings changed" in out
    assert "-> generations[rows_00008-00009]: never materialized" in out and "hidden_states" not in out
    meta = [m for m in _all(project, "generations", SHARDS[0])]
    assert meta[0]["reused"] is True and "tokens_per_s" not in meta[0]  # newest first: kept, not regenerated
    # --force redoes exactly the selection.
    out = eagle3_run(project, "--force", "--select", f"hidden_states[{SHARDS[1]}]")
    assert [line for line in out.splitlines() if line.startswith("-> ")] == [f"-> hidden_states[{SHARDS[1]}]: --force"]
    forced = _all(project, "hidden_states", SHARDS[1])[0]
    assert forced["samples_resumed"] == 0 and forced["tokens_extracted"] == forced["tokens"] > 0  # redone, not kept
    with pytest.raises(AssertionError, match="unknown asset 'hidden_state'"):
        eagle3_run(project, "--select", "hidden_state")
    # Another storage_root (one experiment after another on one instance): what is not there is made there.
    settings["storage_root"] = "data2"
    (project / "eagle3.yaml").write_text(yaml.safe_dump(settings))
    out = eagle3_run(project, "--select", "prompts,generations")
    assert f"-> prompts: materialized, but {project / 'data2' / 'prompts' / 'prompts.parquet'} is not there" in out
    assert (project / "data2" / "generations" / f"{SHARDS[0]}.parquet").is_file()


def _all(project: Path, asset: str, partition: str) -> list[dict]:
    with instance_of(project) as instance:
        flt = AssetRecordsFilter(asset_key=AssetKey(asset), asset_partitions=[partition])
        return [{k: v.value for k, v in r.asset_materialization.metadata.items()}
                for r in instance.fetch_materializations(flt, limit=100).records]


def test_eagle3_ui_and_eagle3_run_started_together_on_a_fresh_project(tiny_target, tmp_path):
    """Both create the instance's storage if nobody has: only one may, the other must wait."""
    from .test_ui_browser import free_port, stop, webserver_answers

    project = make_project(tmp_path / "project", tiny_target)
    port = free_port()
    with open(tmp_path / "ui.log", "w") as log:
        ui = subprocess.Popen(cli("ui", "--port", str(port)), cwd=project, env=env(), stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
        try:
            run = subprocess.run(cli("run", "--select", "prompts"), cwd=project, env=env(), capture_output=True,
                                 text=True, timeout=300)
            assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
            deadline = time.time() + 180
            while not webserver_answers(port):
                assert ui.poll() is None and time.time() < deadline, (tmp_path / "ui.log").read_text()[-3000:]
                time.sleep(1)
            query = json.dumps({"query": "{ runsOrError { ... on Runs { results { jobName status } } } }"}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/graphql", data=query,
                                         headers={"Content-Type": "application/json"})
            runs = json.loads(urllib.request.urlopen(req, timeout=30).read())["data"]["runsOrError"]["results"]
            assert {"jobName": "prompts_job", "status": "SUCCESS"} in runs  # the UI sees the CLI's run
        finally:
            stop(ui)
    assert "already exists" not in (tmp_path / "ui.log").read_text()


def test_select_of_a_shard_that_does_not_exist_is_an_error_that_lists_the_shards(tiny_target, tmp_path):
    from dagster import DagsterInstance

    from eagle3_assets.definitions import build_definitions
    from eagle3_assets.pipeline import run_pipeline
    from eagle3_assets.settings import load_settings

    project = make_project(tmp_path / "project", tiny_target)
    settings = load_settings(project / "eagle3.yaml")
    defs = build_definitions(settings)
    error = rf"^--select: no shard rows_00000-00099; the shards are {SHARDS[0]}, {SHARDS[1]}$"
    with DagsterInstance.ephemeral() as instance:
        with pytest.raises(ValueError, match=error):  # the prompts run first: they make the shards
            run_pipeline(defs, instance, settings, select=["rows_00000-00099"], log=lambda m: None)
        for force in (False, True):  # not "nothing to do", and --force does not advise --force
            with pytest.raises(ValueError, match=error):
                run_pipeline(defs, instance, settings, force=force, select=["hidden_states[rows_00000-00099]"],
                             log=lambda m: None)
        assert [r.job_name for r in instance.get_runs()] == ["prompts_job"]
