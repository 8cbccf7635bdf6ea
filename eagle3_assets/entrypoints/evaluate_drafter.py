"""Pipes entry point of the drafter's evaluation (`python -m`): speculative decoding with the
target, the result written as JSON to `EvalJob.result_path` (per-prompt rows: too big for a
Pipes message); the `drafter_eval` asset reads it and builds its metadata and the model card."""

from __future__ import annotations

from ..core.evaluate import EvalJob, run_eval
from . import report_metadata, run_job

if __name__ == "__main__":
    run_job(EvalJob, run_eval, report_metadata)
