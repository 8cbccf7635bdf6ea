"""A backfill of every shard through the real webserver, daemon and run queue (`dagster dev`):
the shards go through one run (one model load: `BackfillPolicy.single_run()`), one shard fails on
a real fault and leaves the others materialized, then only the failed and missing partitions are
launched again, as the UI's backfill dialog does, and every shard ends materialized."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from dagster import AssetKey, DagsterInstance, DagsterRunStatus, RunsFilter

from eagle3_assets.cli import ensure_instance

from .test_extract_job import write_generations

ROOT = Path(__file__).resolve().parents[1]
SHARDS = ["rows_00000-00004", "rows_00004-00008", "rows_00008-00012"]
BAD = SHARDS[1]

LAUNCH = """mutation($p: LaunchBackfillParams!) { launchPartitionBackfill(backfillParams: $p) {
  __typename ... on LaunchBackfillSuccess { backfillId } ... on PythonError { message } } }"""
STATUS = """query($id: String!) { partitionBackfillOrError(backfillId: $id) {
  __typename ... on PartitionBackfill { status } } }"""


def graphql(port: int, query: str, variables: dict) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/graphql",
        data=json.dumps({"query": query, "variables": variables}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        out = json.load(r)
    assert "errors" not in out, out
    return out["data"]


def wait_backfill(port: int, backfill_id: str, instance: DagsterInstance, timeout: float = 300) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        status = graphql(port, STATUS, {"id": backfill_id})["partitionBackfillOrError"]["status"]
        runs = instance.get_runs(RunsFilter(tags={"dagster/backfill": backfill_id}))
        if status not in ("REQUESTED", "CANCELING") and all(r.is_finished for r in runs):
            return status
        time.sleep(2)
    raise TimeoutError(f"backfill {backfill_id} still {status} after {timeout} s")


def run_shards(run) -> list[str]:
    """The shards a run carries: one partition, or a range of them."""
    if "dagster/partition" in run.tags:
        return [run.tags["dagster/partition"]]
    start, end = run.tags["dagster/asset_partition_range_start"], run.tags["dagster/asset_partition_range_end"]
    return SHARDS[SHARDS.index(start) : SHARDS.index(end) + 1]


def backfill_runs(instance: DagsterInstance, backfill_id: str) -> list[tuple[list[str], DagsterRunStatus]]:
    return [(run_shards(r), r.status) for r in instance.get_runs(RunsFilter(tags={"dagster/backfill": backfill_id}))]


@pytest.fixture
def dagster_dev(tiny_target, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    for f in ("dagster.yaml", "workspace.yaml"):
        shutil.copy(ROOT / f, project / f)
    settings = {
        "target_model": str(tiny_target),
        "storage_root": str(tmp_path / "data"),
        "shard_size": 4,
        "extraction": {"dtype": "float32", "device": "cpu"},
    }
    (project / "eagle3.yaml").write_text(yaml.safe_dump(settings))
    for i, shard in enumerate(SHARDS):
        path = tmp_path / "data" / "generations" / f"{shard}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_generations(path, n=4, seed=i)
    (tmp_path / "data" / "generations" / f"{BAD}.parquet").write_bytes(b"not a parquet file")  # the fault

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "DAGSTER_HOME": str(project), "EAGLE3_SETTINGS": str(project / "eagle3.yaml")}
    cwd = os.getcwd()
    os.chdir(project)  # dagster.yaml's storage paths are relative to the project root
    os.environ["DAGSTER_HOME"] = str(project)
    ensure_instance(project)  # the storage exists before dagster dev and this test open it (else they race)
    log = open(tmp_path / "dagster-dev.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dagster", "dev", "-w", "workspace.yaml", "-p", str(port)],
        cwd=project, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        instance = DagsterInstance.get()
        instance.add_dynamic_partitions("shards", SHARDS)
        deadline = time.time() + 120
        while True:
            try:
                graphql(port, "{ version }", {})
                break
            except Exception:
                if time.time() > deadline or proc.poll() is not None:
                    raise RuntimeError("dagster dev did not start:\n" + (tmp_path / "dagster-dev.log").read_text()[-3000:])
                time.sleep(1)
        yield port, instance, tmp_path
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        os.chdir(cwd)
        os.environ.pop("DAGSTER_HOME", None)


def test_backfill_then_rerun_only_failed_and_missing_shards(dagster_dev):
    port, instance, tmp_path = dagster_dev
    key = AssetKey("hidden_states")

    def launch(partitions: list[str]) -> str:
        out = graphql(port, LAUNCH, {"p": {"assetSelection": [{"path": ["hidden_states"]}], "partitionNames": partitions}})
        result = out["launchPartitionBackfill"]
        assert result["__typename"] == "LaunchBackfillSuccess", result
        return result["backfillId"]

    first = launch(SHARDS)
    wait_backfill(port, first, instance, timeout=420)
    # One run for the three shards; it fails for the bad shard, whose neighbours are materialized.
    assert backfill_runs(instance, first) == [(SHARDS, DagsterRunStatus.FAILURE)]
    materialized = instance.get_materialized_partitions(key)
    assert materialized == {SHARDS[0], SHARDS[2]}

    # The user fixes the fault, then relaunches "failed and missing" partitions only.
    write_generations(tmp_path / "data" / "generations" / f"{BAD}.parquet", n=4, seed=1)
    failed_or_missing = sorted(set(instance.get_dynamic_partitions("shards")) - materialized)
    assert failed_or_missing == [BAD]
    second = launch(failed_or_missing)
    wait_backfill(port, second, instance)
    assert backfill_runs(instance, second) == [([BAD], DagsterRunStatus.SUCCESS)]
    assert instance.get_materialized_partitions(key) == set(SHARDS)
    # Exactly one more run of the failed shard; the good shards did not run again.
    all_runs = instance.get_runs()
    per_shard = {s: sum(1 for r in all_runs if s in run_shards(r)) for s in SHARDS}
    assert per_shard == {SHARDS[0]: 1, BAD: 2, SHARDS[2]: 1}
