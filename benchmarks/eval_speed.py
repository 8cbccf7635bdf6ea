"""Time `drafter_eval`'s work alone: `core.evaluate.evaluate` on the 80 MT-bench first turns, one
process, with the phases' times (load and graph capture, acceptance, speed-up, float32 check).

    python benchmarks/eval_speed.py --drafter .eagle3/data/drafter       # a trained drafter
    python benchmarks/eval_speed.py                                      # a random one: timings only

A random drafter (written to --out) is almost never accepted: its tau is about 1 and its
"speed-up" a slow-down; the times of the phases are what it is for.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def random_drafter(model_dir: Path, out: Path, draft_vocab_size: int) -> Path:
    import torch
    from transformers import AutoConfig

    from eagle3_assets.core.drafter import DrafterConfig, Eagle3Drafter, save_checkpoint
    from eagle3_assets.core.target import load_target_head

    cfg = AutoConfig.from_pretrained(model_dir)
    n = cfg.num_hidden_layers
    embed, _, _ = load_target_head(model_dir)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(DrafterConfig.from_target_config(cfg, draft_vocab_size, [2, n // 2, n - 3]), embed)
    return save_checkpoint(drafter, out, dtype=torch.bfloat16)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="embedded:SmolLM2-135M-Instruct")
    p.add_argument("--drafter", help="a drafter checkpoint folder; default: a random drafter written to --out")
    p.add_argument("--out", default="/tmp/eval_speed_drafter")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--no-graph", action="store_true")
    args = p.parse_args()

    from eagle3_assets.core.evaluate import EvalConfig, EvalJob, evaluate
    from eagle3_assets.core.target import resolve_target

    t0 = time.perf_counter()
    model_dir = resolve_target(args.target)
    drafter = Path(args.drafter) if args.drafter else random_drafter(model_dir, Path(args.out), 32000)
    cfg = EvalConfig(num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                     cuda_graph=not args.no_graph)
    r = evaluate(EvalJob(str(model_dir), str(drafter), cfg))
    keys = ["tau", "prompts_used", "new_tokens", "verify_steps", "batch_size", "cuda_graph", "dtype",
            "load_s", "acceptance_s", "speedup_s", "check_s", "eval_s", "greedy_check_matches", "greedy_check_prompts",
            "speedup_batches"]
    keys += [f"{k}_b{b}" for b in r.get("speedup_batches", []) for k in ("greedy_tok_s", "spec_tok_s", "speedup")]
    print(json.dumps({k: r.get(k) for k in keys} | {"script_s": time.perf_counter() - t0}, indent=1))


if __name__ == "__main__":
    main()
