"""Pipes entry point of the hidden-state extraction of one or several shards (`python -m` or
under torchrun).

Pipes reports one materialization per asset and session, so each shard's result travels as a
custom message, `{"shard", "metadata"}` or `{"shard", "error"}`, sent as soon as the shard is
done; the `hidden_states` asset turns them into one materialization (and check) per partition.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ..core import extract_job
from ..core.extract_job import ExtractJob, ExtractShards, ShardResult, extract_shards
from . import run_job, shard_message

# Tests only: seconds of sleep added to each model load, to stand in for a big target's load,
# and to each packed forward, for a big target's pack.
LOAD_DELAY_ENV = "EAGLE3_TEST_MODEL_LOAD_DELAY_S"
PACK_DELAY_ENV = "EAGLE3_TEST_PACK_DELAY_S"


def shard_result(job: ExtractJob, result: ShardResult | BaseException) -> dict:
    """One shard's custom message: its metadata (plain JSON values) or its error."""
    return shard_message(Path(job.shard_dir).name, result)


def work(group: ExtractShards, log, pipes) -> None:
    """Extract the shards; on rank 0, each shard's message goes out as soon as it is done. Under
    Dagster the asset reads the failures from the messages (the process exits 0, or its messages
    would be lost); run by hand, a failed shard makes the process fail."""
    from dagster_pipes import PipesEnvVarParamsLoader

    failed = []

    def on_shard(job: ExtractJob, result) -> None:
        message = shard_result(job, result)
        if "error" in message:
            log(f"shard {message['shard']} failed: {message['error']}")
            failed.append(message["error"])
        pipes.report_custom_message(message)

    extract_shards(group, log, on_shard)
    if failed and not PipesEnvVarParamsLoader().is_dagster_pipes_process():
        raise RuntimeError(f"{len(failed)} of {len(group.jobs)} shard(s) failed: " + " | ".join(failed))


def report(pipes, group: ExtractShards, _) -> None:
    pass  # every shard was reported as it finished


def _slowed(module, name: str, delay_s: float) -> None:
    """Test hook: `module.name` sleeps `delay_s` before each call."""
    original = getattr(module, name)

    def slow(*args, **kwargs):
        time.sleep(delay_s)
        return original(*args, **kwargs)

    setattr(module, name, slow)


if __name__ == "__main__":
    if os.environ.get(LOAD_DELAY_ENV):
        _slowed(extract_job, "load_model", float(os.environ[LOAD_DELAY_ENV]))
    if os.environ.get(PACK_DELAY_ENV):
        from ..core import extract_engine

        _slowed(extract_engine, "lean_forward", float(os.environ[PACK_DELAY_ENV]))
    run_job(ExtractShards, work, report, stream=True)
