"""Pipes entry point of the generation of one or several shards (`python -m`): the target is
loaded once and answers each shard's prompts in turn (`core.engines.generate_shards`).

Pipes reports one materialization per asset and session, so each shard's result travels as a
custom message, `{"shard", "metadata"}` (`EngineRun.metadata`) or `{"shard", "error"}`, sent by
rank 0 as soon as the shard is done; the `generations` asset turns them into one
materialization per partition and adds its own keys (reuse, hashes).
"""

from __future__ import annotations

from ..core.engines import GenerateJob, GenerateShards, generate_shards
from . import run_job, shard_message


def work(group: GenerateShards, log, pipes) -> None:
    """Answer the shards; each shard's message goes out as soon as it is done. Under Dagster the
    asset reads the failures from the messages (the process exits 0, or its messages would be
    lost); run by hand, a failed shard makes the process fail."""
    from dagster_pipes import PipesEnvVarParamsLoader

    failed = []

    def on_shard(job: GenerateJob, result) -> None:
        message = shard_message(job.shard, result)
        if "error" in message:
            log(f"shard {job.shard} failed: {message['error']}")
            failed.append(message["error"])
        if pipes is not None:
            pipes.report_custom_message(message)

    generate_shards(group, log, on_shard)
    if failed and not PipesEnvVarParamsLoader().is_dagster_pipes_process():
        raise RuntimeError(f"{len(failed)} of {len(group.jobs)} shard(s) failed: " + " | ".join(failed))


def report(pipes, group: GenerateShards, _) -> None:
    pass  # every shard was reported as it finished


if __name__ == "__main__":
    run_job(GenerateShards, work, report, stream=True)
