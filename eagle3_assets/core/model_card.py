"""The drafter's model card (README.md beside its weights): what it was trained on, how long, how
well it drafts, and how to serve it.

Every figure comes from what the run measured and recorded (the prompts' sources, the shard
manifests, the training and evaluation results); nothing here computes a figure of its own.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from .evaluate import speed_text

CARD_NAME = "README.md"


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def serve_commands(verifier: str, exports: dict[str, Path], num_draft_tokens: int) -> str:
    """The commands that serve each export, run from the folder that holds them (`drafter_exports/`):
    the exports by relative paths, which both engines accept; the verifier by the path or id the
    speculators copy names too (vLLM resolves that one from wherever it runs). vLLM reads the drafter
    through --speculative-config (or the speculators copy alone, which names its verifier); SGLang
    drafts a chain of K tokens with top-k 1, verifying K + 1 tokens per step (the same chain as our
    evaluation)."""
    k = num_draft_tokens
    folder = Path(exports["vllm"]).parent
    rel = {e: "./" + Path(p).relative_to(folder).as_posix() if Path(p).parent == folder else str(p) for e, p in exports.items()}
    spec = json.dumps({"method": "eagle3", "model": rel["vllm"], "num_speculative_tokens": k})
    return "\n".join([
        "```bash",
        f"cd {folder}    # the exports' folder: the paths below are relative to it",
        "# vLLM",
        f"vllm serve {verifier} --speculative-config '{spec}'",
        "# vLLM, speculators format (the checkpoint names its verifier)",
        f"vllm serve {rel['speculators']}",
        "# SGLang",
        f"python -m sglang.launch_server --model-path {verifier} --speculative-algorithm EAGLE3 \\",
        f"    --speculative-draft-model-path {rel['sglang']} \\",
        f"    --speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}",
        "```",
    ])


def model_card(
    verifier: str,
    prompts: dict,
    shards: list[tuple],
    generation: dict,
    training: dict,
    evaluation: dict,
    exports: dict[str, Path],
    num_draft_tokens: int,
    target: tuple[str, str] | None = None,
) -> str:
    """Markdown. `verifier` is the target as the serving engines name it (`export.verifier_name`),
    `target` its name and what its weights are (`target.describe_target`); `prompts` and `training`
    are the `prompts` and `drafter` assets' metadata, `shards` the manifests' (shard, samples, tokens,
    bytes), `generation` the generation settings, `evaluation` `core.evaluate.evaluate`'s result."""
    name, weights = target or (verifier, f"`{verifier}`")
    samples = sum(s[1] for s in shards)
    tokens = sum(s[2] for s in shards)
    sources = prompts.get("sources") or []
    out = [
        f"# EAGLE-3 drafter for {name}",
        "",
        f"Trained and measured against {weights}.",
        "",
        f"Trained by eagle3_assets. Acceptance length **tau {evaluation['tau']:.3f}** at K={num_draft_tokens} "
        f"on {evaluation['prompts_used']} prompts of {next(iter(evaluation['sets']), 'the evaluation set')} "
        f"(greedy, {evaluation['config']['max_new_tokens']} new tokens, {evaluation['dtype']}).",
        "",
        "## Data",
        "",
        f"{samples:,} samples, {tokens:,} tokens (prompt and answers) in {len(shards)} shards. The target "
        f"wrote every answer itself: {generation.get('turns', 'first')} turns, "
        f"{generation.get('samples_per_prompt', 0)} sampled answers per prompt beside the greedy one, at most "
        f"{generation.get('max_new_tokens')} new tokens per answer.",
        "",
        _table(["source", "prompts", "licence"], [[s["source"], f"{s['rows']:,}", s["licence"]] for s in sources])
        if sources else "Prompts from one source (no mixture recorded).",
    ]
    if prompts.get("dropped_contaminated"):
        out += ["", f"{prompts['dropped_contaminated']:,} prompts that share n-grams with an evaluation set were dropped."]

    acc = training.get("per_step_accuracy") or []
    out += [
        "",
        "## Training",
        "",
        f"{training['steps']:,} steps, {training['epochs']:.2f} epochs, {training['tokens_seen']:,} tokens seen, "
        f"{training['train_s']:.0f} s of training on {training['processes']} process(es) ({training['device']}); "
        f"stopped by {training['stopped_by']}; final loss {training['final_loss']:.4f}.",
        "",
        "Top-1 agreement with the target on the training data, per training-time-test step (last logged window):",
        "",
        _table([f"step {i}" for i in range(len(acc))], [[f"{a:.3f}" for a in acc]]) if acc else "(not recorded)",
        "",
        "## Evaluation",
        "",
    ]
    counts = Counter((r["set"], r["category"]) for r in evaluation.get("per_prompt", []))
    for name, s in evaluation["sets"].items():
        out += [
            f"**{name}**: tau {s['tau']:.3f} over {s['prompts_used']} prompts.",
            "",
            _table(["category", "prompts", "tau"],
                   [[c, counts.get((name, c), ""), f"{t:.3f}"] for c, t in s["tau_by_category"].items()]),
            "",
        ]
    pos = evaluation["per_position_acceptance"]
    out += [
        "Share of verification steps that accepted the draft at each position:",
        "",
        _table([f"pos {i}" for i in range(len(pos))], [[f"{a:.3f}" for a in pos]]),
    ]
    batches = evaluation.get("speedup_batches") or []
    if batches:
        out += ["", "Target tokens per second, speculative against plain greedy decoding in the same batched engine "
                    f"(ours, {evaluation['dtype']}, {'CUDA graphs' if evaluation.get('cuda_graph') else 'eager'} on "
                    "both sides; not a serving engine):", "",
                _table(["batch", "prompts", "plain greedy tok/s", "speculative tok/s", ""],
                       [[b, evaluation[f"speedup_prompts_b{b}"], f"{evaluation[f'greedy_tok_s_b{b}']:,.0f}",
                         f"{evaluation[f'spec_tok_s_b{b}']:,.0f}", speed_text(evaluation[f"speedup_b{b}"])]
                        for b in batches])]
    if "greedy_check_prompts" in evaluation:
        out += ["", f"In float32 the speculative output equals plain greedy on {evaluation['greedy_check_matches']} of "
                    f"{evaluation['greedy_check_prompts']} prompts."]
    out += ["", "## Serving", "", f"The commands name the target the drafter was trained against: `{verifier}`.", "",
            serve_commands(verifier, exports, num_draft_tokens), ""]
    return "\n".join(out)
