"""Shared Dagster pieces: the shard partitions, the GPU pool, the retry policy, the Pipes client."""

from __future__ import annotations

import sys

from dagster import Backoff, DynamicPartitionsDefinition, Jitter, PipesSubprocessClient, RetryPolicy

from .core.layout import Layout
from .settings import Settings

shards = DynamicPartitionsDefinition(name="shards")

# One GPU job holds the node at a time (run granularity, limit in dagster.yaml).
GPU_POOL = "gpu"

# A GPU job may be preempted or hit a transient fault: retry once after a pause; the rerun
# resumes from the files already written.
GPU_RETRY = RetryPolicy(max_retries=1, delay=10, backoff=Backoff.EXPONENTIAL, jitter=Jitter.PLUS_MINUS)


def layout(settings: Settings) -> Layout:
    return Layout(settings.root)


def pipes_client() -> PipesSubprocessClient:
    return PipesSubprocessClient()


def launch_command(module: str, nproc: int) -> list[str]:
    """A job module as one process, or under torchrun as `nproc` processes."""
    job = ["-m", module]
    if nproc == 1:
        return [sys.executable, *job]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *job]
