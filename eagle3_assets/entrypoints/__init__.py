"""Entry points of the GPU jobs, launched through Dagster Pipes (one process, or torchrun).

Each job reads its parameters (a config dataclass) as JSON from $EAGLE3_JOB_PARAMS. Only rank
0 opens the Pipes session (each asset may be reported once per session) and reports, its log
lines through Pipes (once: not also on stderr); the other ranks, and a job run by hand, log to
stderr.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

PARAMS_ENV = "EAGLE3_JOB_PARAMS"


def stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_job(params_cls, work: Callable, report: Callable, stream: bool = False) -> None:
    """Run `work(params, log)` on every rank; on rank 0 inside a Pipes session, then
    `report(pipes, params, result)`. An exception fails the Dagster step with its message.
    `stream=True` calls `work(params, log, pipes)` (pipes None off rank 0), for a job that
    reports as it goes. A params class with a `from_json` classmethod parses its own JSON. Once the
    job succeeded, a rank of a process group leaves it and ends there (`distributed.leave`)."""
    from dagster_pipes import open_dagster_pipes

    from ..core import distributed, stopping
    from ..core.config import from_json

    # SIGTERM/SIGINT: stop at the next safe point with the work saved; the parent's death sends SIGTERM.
    stopping.stop_on_signals()
    stopping.die_with_parent(parent=os.getppid())
    text = os.environ[PARAMS_ENV]
    params = params_cls.from_json(text) if hasattr(params_cls, "from_json") else from_json(params_cls, text)
    if int(os.environ.get("RANK", 0)) != 0:
        work(params, stderr_log, None) if stream else work(params, stderr_log)
        distributed.leave()
        return
    from dagster_pipes import PipesEnvVarParamsLoader

    under_dagster = PipesEnvVarParamsLoader().is_dagster_pipes_process()
    with open_dagster_pipes() as pipes:

        def log(msg: str) -> None:
            # Under Dagster the line goes through Pipes only: Dagster prints it (and keeps it in the
            # run's log); a copy on stderr would print every line twice. Run by hand: stderr.
            if under_dagster:
                pipes.log.info(msg)
            else:
                stderr_log(msg)

        report(pipes, params, work(params, log, pipes) if stream else work(params, log))
    distributed.leave()


def pipes_metadata(metadata: dict) -> dict:
    """A result's `.metadata()` (plain JSON values) as Pipes metadata: lists and dicts typed as
    JSON, the `path` key as a path. The one place that knows Pipes' metadata types."""
    return {k: path(v) if k == "path" else json_value(v) if isinstance(v, (list, dict)) else v
            for k, v in metadata.items()}


def shard_message(shard: str, result) -> dict:
    """One shard's custom message, for a job over several shards: `{"shard", "metadata"}` (the
    result's `.metadata()`, plain JSON values) or `{"shard", "error"}` for the exception that failed it."""
    if isinstance(result, BaseException):
        return {"shard": shard, "error": f"{type(result).__name__}: {result}"}
    return {"shard": shard, "metadata": result.metadata()}


def report_metadata(pipes, job, result) -> None:
    """The usual `report`: the result's `.metadata()` as the asset's materialization."""
    pipes.report_asset_materialization(metadata=pipes_metadata(result.metadata()))


def path(value: str) -> dict:
    return {"raw_value": value, "type": "path"}


def json_value(value) -> dict:
    return {"raw_value": value, "type": "json"}
