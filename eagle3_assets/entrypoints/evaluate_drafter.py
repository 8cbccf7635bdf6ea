"""Pipes entry point of the drafter's evaluation (`python -m`): speculative decoding with the
target, the result written as JSON to `EvalJob.result_path` (per-prompt rows: too big for a
Pipes message); the `drafter_eval` asset reads it and builds its metadata and the model card."""

from __future__ import annotations

import json
from pathlib import Path

from ..core.evaluate import EvalJob, evaluate
from ..core.files import atomic_write_text
from ..core.target import pick_device
from . import path, run_job


def work(job: EvalJob, log) -> dict:
    result = evaluate(job, log=log)
    if job.result_path:
        atomic_write_text(json.dumps(result, indent=2), Path(job.result_path))
    return result


def report(pipes, job: EvalJob, r: dict) -> None:
    pipes.report_asset_materialization(
        metadata={
            "tau": round(r["tau"], 4),
            "device": pick_device(job.config.device).type,  # the job's device, not the Dagster run's
            **({"path": path(job.result_path)} if job.result_path else {}),
        }
    )


if __name__ == "__main__":
    run_job(EvalJob, work, report)
