"""Pipes entry point of drafter training (`torchrun` over several GPUs: DDP).

The `drafter` asset launches `python -m eagle3_assets.jobs.train_drafter` with the job's
parameters as JSON in $EAGLE3_TRAIN_PARAMS. Rank 0 opens the Pipes session, streams the
training log and reports loss, per-step accuracy and throughput.
"""

from __future__ import annotations

import json
import os
import sys

from dagster_pipes import open_dagster_pipes

from ..core.train import TrainConfig, train_drafter
from . import pipes_and_stderr


def main() -> None:
    p = json.loads(os.environ["EAGLE3_TRAIN_PARAMS"])
    cfg = TrainConfig(**p.pop("cfg"))
    if int(os.environ.get("RANK", 0)) != 0:
        train_drafter(cfg=cfg, log=lambda msg: print(msg, file=sys.stderr, flush=True), **p)
        return
    with open_dagster_pipes() as pipes:
        m = train_drafter(cfg=cfg, log=pipes_and_stderr(pipes), **p)
        acc = [round(a, 5) for a in m["step_accuracy"]]
        pipes.report_asset_materialization(
            metadata={
                "steps": m["steps"],
                "resumed_from_step": m["resumed_from_step"],
                "tokens_seen": m["tokens_seen"],
                "final_loss": round(m["final_loss"], 5),
                **{f"accuracy_step_{k}": a for k, a in enumerate(acc)},
                "per_step_accuracy": {"raw_value": acc, "type": "json"},
                "loss_history": {"raw_value": [round(x, 5) for x in m["loss_history"]], "type": "json"},
                "train_s": round(m["train_s"], 2),
                "tokens_per_s": round(m["tokens_per_s"], 1),
                "processes": m["processes"],
                "aux_layer_ids": {"raw_value": p["aux_layer_ids"], "type": "json"},
                "device": cfg.device,
                "path": {"raw_value": str(p["out_dir"]), "type": "path"},
            }
        )


if __name__ == "__main__":
    main()
