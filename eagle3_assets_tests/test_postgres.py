"""The production instance config (infra/dagster.yaml) against a real PostgreSQL server."""

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest
from dagster import DagsterInstance, materialize

from eagle3_assets.assets import generations, prompts
from eagle3_assets.cli import history
from eagle3_assets.launchers import LocalLauncher
from eagle3_assets.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


def pg_bin(name: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found[-1] if found else shutil.which(name)


@pytest.fixture
def postgres():
    initdb, pg_ctl = pg_bin("initdb"), pg_bin("pg_ctl")
    if not initdb or not pg_ctl:
        pytest.fail("PostgreSQL is not installed (.ci/run installs Debian's postgresql)")
    data = Path(tempfile.mkdtemp(prefix="eagle3-pg-"))
    as_user = []
    if os.geteuid() == 0:  # the server refuses to run as root
        shutil.chown(data, "postgres", "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    subprocess.run([*as_user, initdb, "-D", str(data / "db"), "-A", "trust", "-U", "postgres"], check=True,
                   capture_output=True)
    subprocess.run([*as_user, pg_ctl, "-D", str(data / "db"), "-w", "-l", str(data / "log"), "-o",
                    f"-p {port} -k {data} -c listen_addresses=127.0.0.1", "start"], check=True, capture_output=True)
    try:
        import psycopg2

        conn = psycopg2.connect(host="127.0.0.1", port=port, user="postgres", dbname="postgres")
        conn.autocommit = True
        conn.cursor().execute("CREATE DATABASE dagster")
        conn.close()
        yield port
    finally:
        subprocess.run([*as_user, pg_ctl, "-D", str(data / "db"), "-m", "fast", "stop"], capture_output=True)
        shutil.rmtree(data, ignore_errors=True)


def test_a_partition_runs_against_postgres_and_its_history_reads_back(postgres, tiny_target, tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(ROOT / "infra" / "dagster.yaml", home / "dagster.yaml")
    for k, v in {"HOST": "127.0.0.1", "PORT": str(postgres), "USER": "postgres", "PASSWORD": "", "DB": "dagster"}.items():
        monkeypatch.setenv(f"DAGSTER_PG_{k}", v)
    src = tmp_path / "p.jsonl"
    src.write_text("".join(f'{{"prompt": "question {i}"}}\n' for i in range(4)))
    settings = Settings(target_model=str(tiny_target), prompts_source=str(src), shard_size=2,
                        storage_root=str(tmp_path / "data"),
                        generation={"dtype": "float32", "max_new_tokens": 4, "batch_size": 2})
    instance = DagsterInstance.from_config(str(home))
    assert type(instance.run_storage).__name__ == "PostgresRunStorage"
    assert materialize([prompts.build(settings)], instance=instance).success
    key = instance.get_dynamic_partitions("shards")[1]
    assert key == "rows_00002-00004"
    assert materialize([generations.build(settings)], partition_key=key, instance=instance,
                       resources={"launcher": LocalLauncher()}).success

    fresh = DagsterInstance.from_config(str(home))  # a new connection: the history is in the database
    rows = history(fresh)
    assert [(r["asset"], r["partition"]) for r in rows] == [("prompts", None), ("generations", key)]
    assert rows[1]["metadata"]["samples"] == 2
