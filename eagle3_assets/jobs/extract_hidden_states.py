"""Pipes entry point of the hidden-state extraction job.

Launched by the `hidden_states` asset as `python -m eagle3_assets.jobs.extract_hidden_states`
(or under `torchrun` for several processes), with the job's parameters as JSON in
$EAGLE3_EXTRACT_PARAMS. Only rank 0 opens the Pipes session: each asset may be
reported once per session. Outside Dagster, Pipes is a no-op and the job still runs.
"""

from __future__ import annotations

import json
import os
import sys

from dagster_pipes import open_dagster_pipes

from ..core.extract_job import ExtractParams, run_extraction
from . import pipes_and_stderr


def main() -> None:
    params = ExtractParams(**json.loads(os.environ["EAGLE3_EXTRACT_PARAMS"]))
    if int(os.environ.get("RANK", 0)) != 0:
        run_extraction(params, log=lambda msg: print(msg, file=sys.stderr, flush=True))
        return
    with open_dagster_pipes() as pipes:
        metadata = run_extraction(params, log=pipes_and_stderr(pipes))
        pipes.report_asset_materialization(metadata=pipes_metadata(metadata))


def pipes_metadata(m: dict) -> dict:
    out = dict(m)
    out["path"] = {"raw_value": m["path"], "type": "path"}
    out["aux_layer_ids"] = {"raw_value": m["aux_layer_ids"], "type": "json"}
    return out


if __name__ == "__main__":
    main()
