"""Pipes entry point of drafter training (`python -m` or under torchrun: DDP).

A run that stops before its end (SIGTERM, a time-limited slot) keeps its state and fails the
step with a message that says so: the drafter is not done, and the next materialization
continues the same run.
"""

from __future__ import annotations

import json

from ..core.sample_files import DamagedSampleError
from ..core.train import TrainJob, TrainResult, run_training
from . import report_metadata, run_job

# A learning-curve point travels as a Pipes log line with this prefix, sent as training logs it:
# Pipes delivers log lines while the job runs (custom messages only at its end), and the
# `drafter` asset turns each into an observation at once (observe.py).
CURVE_POINT = "eagle3 learning-curve point: "


class TrainingPaused(RuntimeError):
    pass


def report(pipes, job: TrainJob, result: TrainResult) -> None:
    m = result.metrics
    if result.paused:
        raise TrainingPaused(
            f"training paused after step {m['steps']} of {m['max_steps']} ({m['train_s']:.0f} s trained); its state "
            f"is kept at {job.state_path}: materialize the drafter again (`eagle3 run`) to continue"
        )
    report_metadata(pipes, job, result)


def work(job: TrainJob, log, pipes) -> TrainResult:
    """`run_training`, its learning-curve points sent live through Pipes. A sample file it cannot
    read is named and removed, so its shard is missing a file: the next `eagle3 run` notices it
    (sizes against the manifest), re-extracts that file, and trains. Without that, every rerun
    would fail on the same file."""
    from dagster_pipes import PipesEnvVarParamsLoader

    live = pipes is not None and PipesEnvVarParamsLoader().is_dagster_pipes_process()
    try:
        return run_training(job, log, on_point=(lambda p: pipes.log.info(CURVE_POINT + json.dumps(p))) if live else None)
    except DamagedSampleError as e:
        e.path.unlink(missing_ok=True)
        raise RuntimeError(
            f"{e}; removed it: its shard {e.path.parent.name} is stale, and `eagle3 run` re-extracts the file "
            "before training again") from e


if __name__ == "__main__":
    run_job(TrainJob, work, report, stream=True)
