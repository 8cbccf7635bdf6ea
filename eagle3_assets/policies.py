"""How the GPU assets share the node and recover from a fault."""

from dagster import Backoff, Jitter, RetryPolicy

# One GPU job holds the node at a time (run granularity, limit in dagster.yaml).
GPU_POOL = "gpu"

# A GPU job may be preempted or hit a transient fault: retry once after a pause; the rerun
# resumes from the files (and the training state) already written.
GPU_RETRY = RetryPolicy(max_retries=1, delay=10, backoff=Backoff.EXPONENTIAL, jitter=Jitter.PLUS_MINUS)

# Set by `eagle3 run --force` on its runs: recompute even what a step could keep (the answers of
# unchanged prompt rows, valid sample files).
FORCE_TAG = "eagle3/force"
