"""Entry points of the GPU jobs, launched through Dagster Pipes (one process, or torchrun)."""

import sys


def pipes_and_stderr(pipes):
    """Log to the Dagster run (through Pipes) and to stderr (the job's own log, also outside Dagster)."""

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)
        pipes.log.info(msg)

    return log
