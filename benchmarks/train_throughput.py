"""Drafter training throughput: today's padded path against the packed path, on the same data.

On a GPU (the real measurement): random data of the GPU preset's shape (SmolLM2-135M target:
hidden 576, 9 heads, 3 key-value heads, head size 64, MLP 1,536, vocabulary 49,152; draft
vocabulary 17,920; samples of 64..1,024 tokens, mean about 290; 16,384 batch tokens; 7 TTT
steps; bf16 autocast), preloaded on the card as `training.preload` does, and the training step
of `core/train/` itself (`run_forward` + `run_backward_and_update`, the model from
`place_draft_model`), once with `attention: padded` and once with the packed path:

    PYTHONPATH=. python benchmarks/train_throughput.py --json $OUT/train_throughput.json

prints steps/s, real tokens/s and peak memory of each path after a warm-up, and the relative
difference of loss and gradients of the two on one batch (the padded plan's first batch,
packed for the new path; both in bf16 autocast, so they agree to bf16 rounding, not to 1e-5:
exactness in float32 is eagle3_assets_tests/test_train_fast.py). `--device cpu --tiny` runs
the same steps on a tiny shape (a smoke test). On CUDA a row "packed + CUDA graph"
(`training.cuda_graph`: the whole step captured once, replayed per batch; capture and its
warm-up are outside the timing) follows; `--only graph` times that row alone. There the step
sends only the rows that count in the loss through the head (as training does);
`--rows-baseline` adds the same step with every row through the head, as before.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3_assets.core import drafter as drafter_module  # noqa: E402
from eagle3_assets.core.drafter import DrafterConfig  # noqa: E402
from kernel_profile import profile_steps, sync  # noqa: E402  (benchmarks/, the script's own folder)
from eagle3_assets.core.train import (  # noqa: E402
    GraphedStep,
    TrainConfig,
    _batch_from_cache,
    add_target_in_draft,
    attention_impl,
    graph_optimizer,
    head_row_counts,
    pack_batch,
    pad_batch,
    place_draft_model,
    plan_epoch,
    run_backward_and_update,
    run_forward,
    static_shape,
)

GPU_SHAPE = dict(hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152, draft_vocab=17920,
                 min_len=64, max_len=1024, median_len=230, batch_tokens=16384, ttt_steps=7, samples=3000)
TINY_SHAPE = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=256, draft_vocab=64,
                  min_len=8, max_len=64, median_len=24, batch_tokens=512, ttt_steps=3, samples=120)


BASELINE = "packed + compile + CUDA graph, two-pass loss (c85cd68)"
ALL_ROWS = "packed + compile + CUDA graph, every row through the head (655697e)"


@dataclasses.dataclass
class Ref:  # what plan_epoch reads of a SampleRef; `path` keys the preloaded samples
    path: int
    tokens: int


def make_data(shape: dict, device: torch.device, dtype: torch.dtype, seed: int):
    """Samples as preloaded files look on the device: bf16 aux and last hidden states."""
    g = random.Random(seed)
    torch.manual_seed(seed)
    cache, refs = {}, []
    for i in range(shape["samples"]):
        n = int(min(shape["max_len"], max(shape["min_len"], math.exp(g.gauss(math.log(shape["median_len"]), 0.65)))))
        prompt = max(1, int(n * g.uniform(0.1, 0.5)))
        cache[i] = {
            "input_ids": torch.randint(0, shape["vocab"], (n,), device=device, dtype=torch.int32),
            "loss_mask": torch.cat((torch.zeros(prompt), torch.ones(n - prompt))).to(device=device, dtype=torch.uint8),
            "aux_hidden_states": torch.randn(n, 3 * shape["hidden"], device=device, dtype=dtype),
            "last_hidden_state": torch.randn(n, shape["hidden"], device=device, dtype=dtype) * 2,
        }
        refs.append(Ref(i, n))
    return refs, cache


def make_model(shape: dict, device: torch.device, seed: int):
    torch.manual_seed(seed)
    config = DrafterConfig(
        hidden_size=shape["hidden"], intermediate_size=shape["intermediate"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"], rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, vocab_size=shape["vocab"], draft_vocab_size=shape["draft_vocab"],
        target_hidden_size=shape["hidden"], aux_layer_ids=[2, 15, 27])
    embed = torch.randn(shape["vocab"], shape["hidden"]) * 0.02
    lm_head = torch.randn(shape["vocab"], shape["hidden"]) * 0.05
    d2t = torch.zeros(shape["draft_vocab"], dtype=torch.int64)  # the first draft_vocab target ids
    t2d = torch.zeros(shape["vocab"], dtype=torch.bool)
    t2d[: shape["draft_vocab"]] = True
    return place_draft_model(config, embed, lm_head, d2t, t2d, device)


def time_path(name, cfg: TrainConfig, model0, lm_head, refs, cache, shape, device, warmup: int, steps: int,
              profile: Path | None = None, head_rows: bool = True) -> dict:
    """One path's timing. `head_rows`: the CUDA graph's step sends only the rows that count
    through the head (as training does; False: every row, as before)."""
    model = copy.deepcopy(model0)
    packed = cfg.attention != "padded"
    plan = plan_epoch(refs, cfg.batch_tokens, cfg.max_length, random.Random(cfg.seed), packed)
    counts = head_row_counts(cache, cfg.ttt_steps) if cfg.cuda_graph and head_rows else None
    batches = [_batch_from_cache(b, cache, packed, counts) for b in plan[: warmup + steps]]
    if len(batches) < warmup + steps:
        raise SystemExit(f"{name}: {len(batches)} batches in the data, need {warmup + steps}: raise --samples")
    losses = []
    rows = 0
    if cfg.cuda_graph:
        optimizer = graph_optimizer(model, cfg, device)
        segments, rows = static_shape(refs, cfg, 1, counts)
        graphed = GraphedStep(model, lm_head, model.t2d, shape["draft_vocab"], cfg, device, optimizer, batches[0],
                              segments, head_rows=rows)

        def step(batch):
            losses.append(graphed(batch, cfg.lr)[0])
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95))

        def step(batch):
            loss, _, _ = run_forward(model, lm_head, model.t2d, shape["draft_vocab"], batch, cfg, device)
            run_backward_and_update(loss, model, optimizer, cfg.lr, cfg)
            losses.append(loss.detach())

    for batch in batches[:warmup]:
        step(batch)
    sync(device)
    if profile is not None:
        profile_steps(name, step, batches[warmup:warmup + 5], device, profile)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for batch in batches[warmup:]:
        step(batch)
    sync(device)
    elapsed = time.perf_counter() - t0
    real = sum(int(b["lengths"].sum()) for b in batches[warmup:])
    slots = (cfg.batch_tokens * steps if cfg.cuda_graph else sum(b["input_ids"].numel() for b in batches[warmup:]))
    params = sum(p.numel() for p in model.parameters())
    attention = attention_impl(cfg, device)
    if attention == "flash" and not drafter_module._Flash.ok:
        attention = "math (flash failed)"
    return {
        "path": name, "attention": attention, "head_rows": rows or None, "steps": steps, "seconds": round(elapsed, 3),
        "steps_per_s": steps / elapsed, "tokens_per_s": real / elapsed, "real_tokens_per_batch": real / steps,
        "padding_fraction": 1 - real / slots,
        # the simple count: 6 x parameters x TTT steps per real token
        "model_tflops": 6 * params * cfg.ttt_steps * real / elapsed / 1e12,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "losses": [round(float(x), 4) for x in losses],
    }


def compare_on_one_batch(cfg_old: TrainConfig, cfg_new: TrainConfig, model0, lm_head, refs, cache, shape, device) -> dict:
    """Loss and gradients of both paths on the same samples from the same weights."""
    samples = [cache[r.path] for r in plan_epoch(refs, cfg_old.batch_tokens, None, random.Random(cfg_old.seed))[0]]
    out = {}
    for key, cfg, batch in (("old", cfg_old, pad_batch(samples)), ("new", cfg_new, pack_batch(samples))):
        model = copy.deepcopy(model0)
        loss, losses, _ = run_forward(model, lm_head, model.t2d, shape["draft_vocab"], batch, cfg, device)
        loss.backward()
        out[key] = (loss.item(), [float(x) for x in losses], {n: p.grad.float() for n, p in model.named_parameters()})
    (lo, so, go), (ln, sn, gn) = out["old"], out["new"]
    diff = math.sqrt(sum(float((gn[n] - go[n]).pow(2).sum()) for n in go))
    norm = math.sqrt(sum(float(go[n].pow(2).sum()) for n in go))
    per_param = {n: float((gn[n] - go[n]).norm() / go[n].norm().clamp(min=1e-30)) for n in go}
    return {"samples": len(samples), "loss_old": lo, "loss_new": ln, "loss_rel_diff": abs(ln - lo) / abs(lo),
            "step_loss_rel_diff_max": max(abs(a - b) / abs(a) for a, b in zip(so, sn)),
            "grad_rel_diff": diff / norm, "grad_rel_diff_worst_param": max(per_param.items(), key=lambda kv: kv[1])}


@contextlib.contextmanager
def two_pass_loss():
    """The loss's chunk math as it was before the one-pass kernel (c85cd68): a compiled forward
    kernel and a compiled gradient kernel per chunk, each reading z and the teacher's logits,
    and dweight accumulated through a bf16 product cast to float32. For `--loss-baseline`, whose
    batches also lack the preloaded `target_in_draft` (made again in every step, as then)."""
    from eagle3_assets.core.train import loss as L

    fwd_l, fwd_p = (torch.compile(f, dynamic=True) for f in L._CE_EAGER[:2])
    grad_l = torch.compile(lambda z, lse, t, lse_t, w: ((torch.exp(z.float() - lse[:, None])
                                                         - torch.exp(t.float() - lse_t[:, None])) * w[:, None]
                                                        ).to(z.dtype), dynamic=True)
    grad_p = torch.compile(lambda z, lse, p, w: ((torch.exp(z.float() - lse[:, None]) - p) * w[:, None]).to(z.dtype),
                           dynamic=True)

    def both_l(z, t, lse_t, w):
        lse, pz, am = fwd_l(z, t, lse_t)
        return lse, pz, am, grad_l(z, lse, t, lse_t, w)

    def both_p(z, p, w):
        lse, pz, am = fwd_p(z, p)
        return lse, pz, am, grad_p(z, lse, p, w)

    saved = L._ce_compiled, L._mm_out_dtype
    L._ce_compiled = {"forward_logits": fwd_l, "forward_probs": fwd_p, "fused_logits": both_l, "fused_probs": both_p,
                      "forward_logits_at": lambda z, t, lse_t, i: fwd_l(z, t[i], lse_t[i]),
                      "fused_logits_at": lambda z, t, lse_t, i, w: both_l(z, t[i], lse_t[i], w)}
    L._mm_out_dtype = False
    try:
        yield
    finally:
        L._ce_compiled, L._mm_out_dtype = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny shape (CPU smoke test)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per path (default 20; tiny 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5; tiny 1)")
    ap.add_argument("--samples", type=int, default=None)
    ap.add_argument("--batch-tokens", type=int, default=None)
    ap.add_argument("--draft-vocab", type=int, default=None)
    ap.add_argument("--attention", default="auto", choices=["auto", "flash", "math"], help="the new path's attention")
    ap.add_argument("--skip-old", action="store_true", help="time only the new path")
    ap.add_argument("--no-compile", action="store_true",
                    help="skip the third path (the new one with training.compile: the loss math under torch.compile)")
    ap.add_argument("--only", choices=["graph"], default=None,
                    help="time only the CUDA-graph rows (packed + CUDA graph, and with compile unless --no-compile)")
    ap.add_argument("--loss-baseline", action="store_true",
                    help="also time the compiled CUDA-graph path with the loss's previous two-pass chunk math")
    ap.add_argument("--rows-baseline", action="store_true",
                    help="also time the compiled CUDA-graph path with every row of the packed row through the head")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--loss-chunk-tokens", type=int, default=None, help="training.loss_chunk_tokens (default 4096)")
    ap.add_argument("--profile", type=Path, default=None,
                    help="also profile 5 steps of each timed path (torch.profiler): GPU kernel time per step "
                         "against the wall time, and the top kernels, written to this file")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    device = torch.device(args.device)
    shape = dict(TINY_SHAPE if args.tiny else GPU_SHAPE)
    for key in ("samples", "batch_tokens", "draft_vocab"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    steps = args.steps or (3 if args.tiny else 20)
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 5)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    refs, cache = make_data(shape, device, dtype, args.seed)
    model0, lm_head = make_model(shape, device, args.seed)
    add_target_in_draft(cache, lm_head, model0.t2d)  # as training.preload does (build_data)
    common = dict(batch_tokens=shape["batch_tokens"], ttt_steps=shape["ttt_steps"], lr=1e-4, seed=args.seed)
    if args.loss_chunk_tokens:
        common["loss_chunk_tokens"] = args.loss_chunk_tokens
    cfg_old = TrainConfig(attention="padded", **common)
    cfg_new = TrainConfig(attention=args.attention, **common)
    mean_len = sum(r.tokens for r in refs) / len(refs)
    print(f"device {device}, {len(refs)} samples, mean length {mean_len:.0f}, batch_tokens {shape['batch_tokens']}, "
          f"{shape['ttt_steps']} TTT steps, draft vocab {shape['draft_vocab']}", flush=True)

    results = {"device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
               "torch": torch.__version__, "shape": shape, "mean_length": mean_len, "warmup": warmup, "paths": []}
    if args.only is None:
        results["same_batch"] = compare_on_one_batch(cfg_old, cfg_new, model0, lm_head, refs, cache, shape, device)
        print(f"same batch: loss old {results['same_batch']['loss_old']:.5f} new "
              f"{results['same_batch']['loss_new']:.5f} (rel diff {results['same_batch']['loss_rel_diff']:.2e}), "
              f"gradient rel diff {results['same_batch']['grad_rel_diff']:.2e}", flush=True)
    paths = [("old (padded)", cfg_old), ("new (packed)", cfg_new)]
    if device.type == "cuda" and not args.no_compile:
        paths.append(("new + compile", dataclasses.replace(cfg_new, compile=True)))
    if device.type == "cuda":
        # max_length: the data's longest sample (nothing is cut), FlashAttention's fixed max_seqlen
        cfg_graph = dataclasses.replace(cfg_new, cuda_graph=True, max_length=shape["max_len"])
        paths.append(("packed + CUDA graph", cfg_graph))
        if not args.no_compile:
            paths.append(("packed + compile + CUDA graph", dataclasses.replace(cfg_graph, compile=True)))
            if args.rows_baseline:
                paths.append((ALL_ROWS, dataclasses.replace(cfg_graph, compile=True)))
            if args.loss_baseline:
                paths.append((BASELINE, dataclasses.replace(cfg_graph, compile=True)))
    if args.only == "graph":
        paths = [(n, c) for n, c in paths if c.cuda_graph]
        if not paths:
            raise SystemExit("--only graph needs a CUDA device")
    for name, cfg in paths:
        if args.skip_old and cfg is cfg_old:
            continue
        try:
            with two_pass_loss() if name == BASELINE else contextlib.nullcontext():
                data = cache if name != BASELINE else {  # c85cd68 made the flags in every step
                    p: {k: v for k, v in s.items() if k != "target_in_draft"} for p, s in cache.items()}
                results["paths"].append(time_path(name, cfg, model0, lm_head, refs, data, shape, device, warmup,
                                                  steps, args.profile, head_rows=name not in (BASELINE, ALL_ROWS)))
        except Exception as e:  # noqa: BLE001 (a failed compile is reported, not the end of the table)
            if cfg is cfg_old or cfg is cfg_new:
                raise
            results.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:2000]
            print(f"{name}: failed: {type(e).__name__}: {str(e)[:500]}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not args.skip_old and args.only is None:
        base = results["paths"][0]["tokens_per_s"]
        for r in results["paths"]:
            r["speedup"] = r["tokens_per_s"] / base

    print("\n| path | attention | steps/s | real tok/s | speed-up | tok/batch | padding | model TFLOP/s | peak GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results["paths"]:
        peak = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "-"
        print(f"| {r['path']} | {r['attention']} | {r['steps_per_s']:.2f} | {r['tokens_per_s']:,.0f} | "
              f"{r.get('speedup', float('nan')):.2f}x | "
              f"{r['real_tokens_per_batch']:,.0f} | {r['padding_fraction']:.1%} | {r['model_tflops']:.1f} | {peak} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
