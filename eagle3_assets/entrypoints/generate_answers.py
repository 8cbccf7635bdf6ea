"""Pipes entry point of one shard's generation (`python -m`): the target answers the shard's
prompts and rank 0 reports the figures (`EngineRun.metadata`); the `generations` asset adds its
own (reuse, hashes)."""

from __future__ import annotations

from ..core.engines import GenerateJob, run_generation
from . import report_metadata, run_job

if __name__ == "__main__":
    run_job(GenerateJob, run_generation, report_metadata)
