"""How much of the teacher a top-k keeps: for k in a few sizes, the mean share of the target's
next-token distribution over the draft vocabulary (softmax of the draft logits, what training
fits) that its k most likely draft tokens hold. Training renormalizes the stored top-k, so the
total-variation distance between the teacher it fits and the full one is 1 - that share.

CPU-sized: teacher-forced on the first ShareGPT answers (written by another model, so the
target is less sure of them than of its own greedy answers, which the pipeline trains on:
a conservative figure), answer positions only, float32.

    python benchmarks/topk_mass.py --samples 24 --max-tokens 256 [--draft-vocab 4096] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3_assets.core.prompts import _records, resolve_source  # noqa: E402
from eagle3_assets.core.target import load_tokenizer, resolve_target  # noqa: E402
from eagle3_assets.core.vocab import build_vocab_map, count_tokens  # noqa: E402

KS = (4, 8, 16, 32, 64, 128)


def conversations(n: int):
    """(user, assistant) first turns of the embedded ShareGPT file."""
    path = resolve_source("embedded:sharegpt")
    for _, record in _records(path, embedded=True):
        turns = record.get("conversations") or []
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            if turns[0]["value"].strip() and turns[1]["value"].strip():
                yield turns[0]["value"].strip(), turns[1]["value"].strip()
                n -= 1
                if n == 0:
                    return


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="embedded:SmolLM2-135M-Instruct")
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--draft-vocab", type=int, default=4096, help="the demo's draft vocabulary size")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    model_dir = resolve_target(args.target)
    tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    samples = []
    for user, answer in conversations(args.samples):
        prompt = tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False)
        p_ids = tok(prompt, add_special_tokens=False).input_ids[: args.max_tokens // 2]
        a_ids = tok(answer, add_special_tokens=False).input_ids[: args.max_tokens - len(p_ids)]
        samples.append((p_ids + a_ids, [0] * len(p_ids) + [1] * len(a_ids)))
    counts = count_tokens(samples, model.config.vocab_size)
    _, t2d = build_vocab_map(counts, min(args.draft_vocab, model.config.vocab_size))
    kept = {k: [] for k in KS}
    full_kept = {k: [] for k in KS}
    in_draft = []
    tokens = 0
    with torch.no_grad():
        for ids, mask in samples:
            logits = model(torch.tensor([ids])).logits[0].float()
            answer = torch.tensor(mask, dtype=torch.bool)
            answer[:-1] = answer[1:].clone()  # positions that predict an answer token
            answer[-1] = False
            logits = logits[answer]
            tokens += logits.shape[0]
            p_full = torch.softmax(logits, -1)
            p_draft = torch.softmax(logits[:, t2d], -1)
            in_draft.append(t2d[logits.argmax(-1)].float())
            for k in KS:
                kept[k].append(p_draft.topk(k, -1).values.sum(-1))
                full_kept[k].append(p_full[:, t2d].topk(k, -1).values.sum(-1))
    result = {
        "target": args.target, "samples": len(samples), "answer_positions": tokens, "draft_vocab": int(t2d.sum()),
        "argmax_in_draft": round(float(torch.cat(in_draft).mean()), 4),
        "draft_topk_mass": {k: round(float(torch.cat(v).mean()), 4) for k, v in kept.items()},
        "draft_topk_mass_p10": {k: round(float(torch.cat(v).quantile(0.1)), 4) for k, v in kept.items()},
        "full_topk_mass": {k: round(float(torch.cat(v).mean()), 4) for k, v in full_kept.items()},
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
