"""How the GPU assets share the node and recover from a fault; and which of Dagster's
experimental-feature warnings we silence because we use those features on purpose."""

import re
import warnings

from dagster import Backoff, BetaWarning, Jitter, PreviewWarning, RetryPolicy

# Opted into knowingly (README, "Operating it"): a shard check per partition, one run for a range
# of shards, and the Pipes message reader Dagster's own subprocess client uses. Each is matched by
# its message, so a warning about any other experimental feature still shows.
OPTED_IN = (
    (PreviewWarning, "Specifying a partitions_def on an AssetCheckSpec"),
    (BetaWarning, "Parameter `backfill_policy` of function `asset`"),
    (PreviewWarning, "Function `PipesMessageReader.expected_writer_count`"),
)
for _category, _message in OPTED_IN:
    warnings.filterwarnings("ignore", message=re.escape(_message), category=_category)

# One GPU job holds the node at a time (run granularity, limit in dagster.yaml).
GPU_POOL = "gpu"

# A GPU job may be preempted or hit a transient fault: retry once after a pause; the rerun
# resumes from the files (and the training state) already written.
GPU_RETRY = RetryPolicy(max_retries=1, delay=10, backoff=Backoff.EXPONENTIAL, jitter=Jitter.PLUS_MINUS)

# Set by `eagle3 run --force` on its runs: recompute even what a step could keep (the answers of
# unchanged prompt rows, valid sample files).
FORCE_TAG = "eagle3/force"
