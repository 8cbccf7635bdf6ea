"""BENCHMARKS.md's pipeline table, from `eagle3 history --json` of a run (nothing re-measured).

    eagle3 history --json > history.json
    python benchmarks/pipeline_table.py history.json [--since ISO-TIMESTAMP]

One row per materialization (the latest of each asset and shard), with the figures the assets
themselves reported: rates, times, bytes, tau.
"""

from __future__ import annotations

import argparse
import json

FIGURES = {
    "prompts": [("rows", "{:,} rows"), ("shards", "{} shards")],
    "generations": [("answer_tokens", "{:,} answer tokens"), ("tokens_per_s", "**{:,.0f} answer tok/s**"),
                    ("generate_s", "{:.2f} s"), ("setup_s", "set-up {:.2f} s"), ("setup_capture_s", "of which capture {:.2f} s"),
                    ("between_calls_s", "between calls {:.2f} s"), ("prefill_s", "prefill {:.2f} s"),
                    ("decode_s", "decode {:.2f} s"), ("mean_slot_occupancy", "occupancy {:.2f}"),
                    ("engine", "engine {}"), ("model_load_s", "model load {:.2f} s")],
    "hidden_states": [("tokens", "{:,} tokens"), ("tokens_per_s", "**{:,.0f} tok/s**"), ("extract_s", "{:.1f} s"),
                      ("model_load_s", "model load {:.2f} s"), ("warmup_s", "warm-up {:.2f} s"),
                      ("job_s", "job {:.1f} s"), ("bytes_on_disk", "{:,} bytes")],
    "vocab_map": [("draft_vocab_size", "{:,} draft tokens"), ("token_coverage", "coverage {:.4f}")],
    "drafter": [("steps", "{:,} steps"), ("train_s", "{:.1f} s"), ("tokens_per_s", "**{:,.0f} tok/s**"),
                ("stopped_by", "stopped by {}"), ("final_loss", "loss {:.3f}"), ("preload_s", "preload {:.1f} s")],
    "drafter_eval": [("tau", "**tau {:.3f}**"), ("prompts_used", "{} prompts"), ("acceptance_s", "{:.1f} s"),
                     ("eval_s", "{:.1f} s in all"), ("speedup_b1", "batch 1: {:.2f}x"),
                     ("speedup_b16", "batch 16: {:.2f}x"),
                     ("greedy_check_matches", "float32 check {} matches")],
}


def table(rows: list[dict], since: str | None = None) -> str:
    latest: dict[tuple, dict] = {}
    for r in rows:
        if since and r["timestamp"] < since:
            continue
        latest[(r["asset"], r["partition"])] = r  # rows come in time order: the last one wins
    order = list(FIGURES)
    lines = ["| asset | shard | figures (from its metadata) |", "| --- | --- | --- |"]
    for (asset, partition), r in sorted(latest.items(), key=lambda kv: (order.index(kv[0][0]), kv[0][1] or "")):
        m = r["metadata"]
        cells = [fmt.format(m[key]) for key, fmt in FIGURES.get(asset, []) if m.get(key) is not None]
        lines.append(f"| {asset} | {partition or ''} | {', '.join(cells)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("history", help="the output of `eagle3 history --json`")
    ap.add_argument("--since", help="only materializations at or after this ISO timestamp")
    args = ap.parse_args()
    print(table(json.load(open(args.history)), args.since))


if __name__ == "__main__":
    main()
