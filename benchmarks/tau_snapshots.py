"""Tau per minute of training (issue 19 item 5): the acceptance length of every snapshot that an
`eagle3 run` with `training.snapshot_at_s` left beside its drafter, measured by the same
`core.evaluate` that the drafter_eval asset runs (the same prompts and settings; no speed-up and no
float32 check, which do not change tau). The final drafter's tau is drafter_eval's own, from the run.

    python benchmarks/tau_snapshots.py --settings eagle3_assets/defaults/gpu.yaml --json $OUT/tau_snapshots.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3_assets.core.evaluate import EvalJob, evaluate  # noqa: E402
from eagle3_assets.core.target import resolve_target  # noqa: E402
from eagle3_assets.resources import layout  # noqa: E402
from eagle3_assets.settings import load_settings  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", required=True)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    settings = load_settings(args.settings)
    drafter = layout(settings).drafter
    snapshots = sorted((drafter / "snapshots").glob("t*"))
    if not snapshots:
        raise SystemExit(f"no snapshots under {drafter / 'snapshots'}: set training.snapshot_at_s and run eagle3 run")
    model_dir = resolve_target(settings.target_model, settings.model_cache_dir)
    cfg = dataclasses.replace(settings.eval, speedup_prompts=0, greedy_check_prompts=0)
    rows = []
    for snap in snapshots:
        t0 = time.perf_counter()
        r = evaluate(EvalJob(str(model_dir), str(snap), cfg), log=lambda msg: None)
        rows.append({"snapshot": snap.name, "train_s": float(snap.name[1:]), "tau": r["tau"],
                     "tau_by_category": r["sets"][next(iter(r["sets"]))]["tau_by_category"],
                     "per_position_acceptance": r["per_position_acceptance"], "eval_s": time.perf_counter() - t0})
        print(f"{snap.name}: tau {r['tau']:.3f} ({rows[-1]['eval_s']:.1f} s)", flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
