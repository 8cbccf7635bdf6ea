"""Hidden-state extraction throughput, in one run: ceilings, the peers' way, and our engine.

On a GPU (the real measurement), a Llama-3.1-8B-shaped model with random bf16 weights built
directly on the card, seeded samples of 256-4096 tokens, real files written to local disk:

    PYTHONPATH=. python benchmarks/extract_throughput.py --out-dir /tmp/xbench --json $OUT/extract.json

`--tiny` runs the same steps on a tiny model (a CPU smoke test). Prints a table last.

`--arch qwen3_moe` (the Qwen3-30B-A3B shape: 30.5B parameters, 48 layers, 128 experts, 8
active) and `--arch deepseek_v3` (DeepSeek-V3's architecture, Kimi-K2's: MLA with a low-rank
query, V3's grouped routing, a shared expert; a 2,048-wide, 27-layer, 96-expert shape: 23.0B
parameters, 3.2B active) build a random-weight MoE of >= 20B parameters in bf16 on one H200, 48 samples
of 256-2,048 tokens by default, and add the transformers base forward over right-padded
batches (`--padded-batch` rows, writing nothing) and our engine's padded-batch fallback (what
tensor parallelism runs) to the table, with tokens/s and bytes per token:

    PYTHONPATH=. python benchmarks/extract_throughput.py --arch qwen3_moe --skip-durable --json $OUT/moe.json

`--fp32-slice` (MoE) first compares a 4-layer float32 slice of the shape with transformers, in
float32 and in bf16 (issue 21: <= 1e-4, and at most 1.5x transformers' own bf16 error); `--int4`
(MoE) last re-runs the forward and the engine with the routed experts in Kimi-K2's INT4
(compressed-tensors pack-quantized, group 32), dequantized per layer: memory held beside bf16.
`benchmarks/h200_moe.sh` runs both shapes that way in one device call.

`--model DIR --generations FILE[,FILE...]` measures the engine on a real target and the rows of
real `generations` shards instead (the model loaded as the extraction job loads it, one warm-up
forward, then the engine with files written): the reference that `eagle3 run`'s per-shard
`tokens_per_s` is compared with in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from eagle3_assets.core.extract_engine import LayerCapture, extract_samples, forward_batch, plan_packs, warm_up
from eagle3_assets.core.lean_forward import lean_forward, lean_supported
from eagle3_assets.core.sample_files import SampleLayout, read_sample, sample_file, validate_sample

ROWS: list[tuple[str, float, str]] = []
RESULTS: dict = {}


def log(msg: str) -> None:
    print(msg, flush=True)


JSON_PATH: list[Path] = []  # --json: rewritten after every row, so a run cut by its time limit keeps what it measured


def save_json() -> None:
    if JSON_PATH:
        JSON_PATH[0].parent.mkdir(parents=True, exist_ok=True)
        JSON_PATH[0].write_text(json.dumps(RESULTS, indent=2))


def row(name: str, tok_s: float, note: str = "") -> None:
    ROWS.append((name, tok_s, note))
    RESULTS[name] = {"tokens_per_s": tok_s, "note": note}
    log(f"  -> {name}: {tok_s:,.0f} tok/s {note}")
    save_json()


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def moe_config(arch: str, tiny: bool):
    """A random-weight MoE target: the Qwen3-30B-A3B shape, or DeepSeek-V3's architecture at a
    size that fits one H200 in bf16 (>= 20B parameters either way); tiny ones for the CPU."""
    from transformers import DeepseekV3Config, Qwen3MoeConfig

    if arch == "qwen3_moe":
        if tiny:
            return Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=6,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                                  num_experts_per_tok=2, vocab_size=1000, max_position_embeddings=8192)
        return Qwen3MoeConfig(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                              num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                              num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936, rms_norm_eps=1e-6,
                              max_position_embeddings=40960, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                              tie_word_embeddings=False)
    if tiny:
        return DeepseekV3Config(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=6,
                                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                                n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32,
                                kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=1000,
                                max_position_embeddings=8192)
    return DeepseekV3Config(hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
                            num_attention_heads=16, num_key_value_heads=16, n_routed_experts=96, num_experts_per_tok=8,
                            n_group=8, topk_group=4, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                            q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                            vocab_size=163840, max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=False)


def build_model(tiny: bool, dev, arch: str = "llama"):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if arch != "llama":
        cfg = moe_config(arch, tiny)
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        t0 = time.perf_counter()
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        with torch.device(dev):  # straight into bf16 on the card: a float32 detour would not fit
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
        with torch.no_grad():  # random, never zeros: norms too (HF inits them to ones)
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.8, 1.2)
        sync(dev)
        total = sum(p.numel() for p in model.parameters())
        log(f"{arch} model built on {dev} in {time.perf_counter() - t0:.1f} s: {total / 1e9:.2f}B parameters, "
            f"{active_params(model) / 1e9:.2f}B active per token; dtype {model.dtype}")
        RESULTS.update(arch=arch, params=total, active_params=active_params(model))
        return model
    if tiny:
        cfg = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=6, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=1000, max_position_embeddings=8192)
    else:
        cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
                          rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 8192},
                          tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16 if dev.type == "cuda" else torch.float32).eval()
    with torch.no_grad():  # random, never zeros: norms too (HF inits them to ones)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.8, 1.2)
    sync(dev)
    std = model.model.layers[0].mlp.gate_proj.weight.float().std().item()
    log(f"model built on {dev} in {time.perf_counter() - t0:.1f} s; weight std {std:.4f}; dtype {model.dtype}")
    assert std > 0
    return model


def make_samples(n: int, lo: int, hi: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = int(torch.randint(lo, hi + 1, (1,), generator=g))
        ids = torch.randint(0, vocab, (t,), generator=g).tolist()
        prompt = int(torch.randint(1, max(2, t // 2), (1,), generator=g))
        mask = [0] * prompt + [1] * (t - prompt)
        out.append((i, ids, mask))
    return out


def active_params(model) -> float:
    """Parameters a token passes through: every expert bank counted at top-k / experts."""
    cfg = model.config
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "n_routed_experts", None)
    total = 0.0
    for name, p in model.named_parameters():
        routed = experts and ".experts." in name and p.dim() == 3
        total += p.numel() * (cfg.num_experts_per_tok / experts if routed else 1.0)
    return total


def flops_per_token(model, samples) -> tuple[float, float]:
    """(2 x active non-embedding params, causal attention FLOPs per token averaged over the samples)."""
    cfg = model.config
    embed = model.model.embed_tokens.weight.numel()
    params = active_params(model.model) - embed  # the base model: the engine computes no logits
    layers = cfg.num_hidden_layers
    # the width of QK^T and of PV per layer: heads x head size (MLA: query/key and value head sizes differ)
    if getattr(cfg, "kv_lora_rank", None) is not None:
        width = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) / 2
    else:
        width = cfg.num_attention_heads * (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    tokens = sum(len(s[1]) for s in samples)
    # QK^T and PV: 2 x 2 x ctx x width FLOPs per token per layer, ctx averaging (T+1)/2 over a causal sample
    attn = sum(2 * width * layers * len(s[1]) * (len(s[1]) + 1) for s in samples) / tokens
    return 2.0 * params, attn


def matmul_ceiling(dev, tiny: bool) -> float:
    n = 512 if tiny else 8192
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    mats = [(torch.randn(n, n, device=dev, dtype=dt), torch.randn(n, n, device=dev, dtype=dt)) for _ in range(3)]
    for a, b in mats:
        a @ b
    sync(dev)
    reps, times = 10, []
    for _ in range(9 if not tiny else 3):  # median of 9 timings of 10 back-to-back products (rotating inputs)
        sync(dev)
        t0 = time.perf_counter()
        for i in range(reps):
            a, b = mats[i % 3]
            a @ b
        sync(dev)
        times.append((time.perf_counter() - t0) / reps)
    times.sort()
    return 2 * n**3 / times[len(times) // 2]


def disk_ceiling(path: Path, nbytes: int) -> float:
    """fsync'd large sequential write, bytes/s."""
    chunk = os.urandom(64 << 20)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    t0 = time.perf_counter()
    written = 0
    while written < nbytes:
        written += os.write(fd, chunk)
    os.fsync(fd)
    dt = time.perf_counter() - t0
    os.close(fd)
    path.unlink()
    return written / dt


def reset_dir(d: Path) -> Path:
    shutil.rmtree(d, ignore_errors=True)  # deleting drops the dirty pages: no writeback left over
    d.mkdir(parents=True)
    os.sync()
    return d


def peers_way(model, samples, out: Path, aux_ids, dev) -> float:
    """One sample at a time, full LM (logits), output_hidden_states=True, torch.save per sample."""
    def one(row_id, ids, mask):
        with torch.inference_mode():
            o = model(input_ids=torch.tensor([ids], device=dev), output_hidden_states=True)
            hs = o.hidden_states
            aux = torch.cat([hs[j] for j in aux_ids], dim=-1)[0]
            torch.save({"input_ids": torch.tensor(ids, dtype=torch.int32), "loss_mask": torch.tensor(mask, dtype=torch.uint8),
                        "aux_hidden_states": aux.cpu(), "last_hidden_state": hs[-1][0].cpu()},
                       out / f"{row_id:07d}.pt")
            assert o.logits.shape[-1] == model.config.vocab_size
    one(*samples[0])  # warm-up (not timed)
    sync(dev)
    t0 = time.perf_counter()
    for s in samples:
        one(*s)
    sync(dev)
    return time.perf_counter() - t0


def hf_base_no_save(base, samples, aux_ids, dev) -> float:
    cap = LayerCapture(base, aux_ids)
    try:
        for _, ids, _ in sorted(samples, key=lambda s: -len(s[1]))[:2]:  # warm-up: allocator grown, kernels picked
            forward_batch(base, cap, [ids], dev)
        sync(dev)
        t0 = time.perf_counter()
        for _, ids, _ in samples:
            aux, last = forward_batch(base, cap, [ids], dev)
        sync(dev)
        return time.perf_counter() - t0
    finally:
        cap.remove()


def hf_padded_no_save(base, samples, aux_ids, dev, batch: int) -> float:
    """transformers' base forward over right-padded batches of `batch` length-sorted samples, with
    the hooks, writing nothing: what batching alone gives (the 22k tok/s reference of issue 15)."""
    cap = LayerCapture(base, aux_ids)
    order = sorted(samples, key=lambda s: -len(s[1]))
    batches = [[s[1] for s in order[i : i + batch]] for i in range(0, len(order), batch)]
    try:
        forward_batch(base, cap, batches[0], dev)  # warm-up: the longest batch first
        sync(dev)
        t0 = time.perf_counter()
        for b in batches:
            aux, last = forward_batch(base, cap, b, dev)
        sync(dev)
        return time.perf_counter() - t0
    finally:
        cap.remove()


def lean_no_save(base, samples, aux_ids, batch_tokens, dev) -> float:
    packs = plan_packs([len(s[1]) for s in samples], batch_tokens)
    for p in packs[:2]:  # warm-up: the largest packs come first
        lean_forward(base, [samples[i][1] for i in p], aux_ids, torch.bfloat16)
    sync(dev)
    t0 = time.perf_counter()
    for p in packs:
        aux, last = lean_forward(base, [samples[i][1] for i in p], aux_ids, torch.bfloat16)
    sync(dev)
    return time.perf_counter() - t0


def check_against_hf(model, samples, aux_ids, out: Path, dtype, batch_tokens, fp32: bool = True) -> dict:
    """Relative error (per sample, the worst) of the engine's bf16 files (short samples packed
    together) and of HF's own bf16 `output_hidden_states`, both against HF run in float32.
    `fp32=False` (a model too big for a float32 copy on the card): the engine against HF bf16 only."""
    import copy

    pick = sorted(samples, key=lambda s: len(s[1]))[:3] + [max(samples, key=lambda s: len(s[1]))]
    extract_samples(model.model, pick, out, aux_layer_ids=aux_ids, dtype=dtype, batch_tokens=batch_tokens,
                    writer_threads=2, metadata={"check": "1"})
    ref_model = copy.deepcopy(model.model).float() if fp32 else model.model

    def hf(m, ids):
        with torch.inference_mode():
            hs = m(input_ids=torch.tensor([ids], device=model.device), output_hidden_states=True).hidden_states
        return torch.cat([torch.cat([hs[j] for j in aux_ids], -1)[0], hs[-1][0]], -1).float().cpu()

    res = {"engine_vs_fp32": 0.0, "hf_bf16_vs_fp32": 0.0, "engine_vs_hf_bf16": 0.0}
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    for row_id, ids, _ in pick:
        got = read_sample(sample_file(out, row_id))
        mine = torch.cat([got["aux_hidden_states"], got["last_hidden_state"]], -1).float()
        assert torch.isfinite(mine).all()
        ref, hf16 = hf(ref_model, ids), hf(model.model, ids)
        for k, v in (("engine_vs_fp32", rel(mine, ref)), ("hf_bf16_vs_fp32", rel(hf16, ref)),
                     ("engine_vs_hf_bf16", rel(mine, hf16))):
            res[k] = max(res[k], v)
    del ref_model
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def slice_check(arch: str, dev, layers: int = 4, tiny: bool = False, lengths=(700, 300, 180, 41)) -> dict:
    """Issue 21's check of the full-width shape: a `layers`-layer slice (random weights, the shape's
    widths, experts and routing) built in float32, a pack of `lengths` samples. Our packed forward
    against transformers' `output_hidden_states`, both float32 (relative error, the worst sample);
    then both in bf16 against transformers' float32: ours may be at most 1.5x transformers' own."""
    from transformers import AutoModel

    from eagle3_assets.core.moe import moe_path

    cfg = moe_config(arch, tiny)
    cfg.num_hidden_layers = layers
    if hasattr(cfg, "mlp_only_layers"):
        cfg.mlp_only_layers = []
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(1)
    with torch.device(dev):
        base = AutoModel.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in base.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.8, 1.2)
        for name, b in base.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.02)
    aux_ids = [1, layers // 2, layers]
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, cfg.vocab_size, (t,), generator=g).tolist() for t in lengths]

    # The experts each token was routed to, per MoE layer (the router's top-k, in token order): a
    # token whose scores are nearly tied may pick another expert under bf16 rounding, a discrete
    # jump in its hidden state that shows as error; the share of such tokens says how much.
    routes: list[torch.Tensor] = []
    gates = [layer.mlp.gate for layer in base.layers if hasattr(layer.mlp, "gate")]
    for gate in gates:
        gate.register_forward_hook(lambda m, args, out: routes.append(out[2].sort(-1).values.cpu()))

    def by_layer(samples: int) -> list[torch.Tensor]:  # per-sample runs: sample-major -> per layer, token order
        return [torch.cat([routes[i * len(gates) + g] for i in range(samples)]) for g in range(len(gates))]

    def hf(m):
        out = []
        routes.clear()
        with torch.inference_mode():
            for ids in seqs:
                hs = m(input_ids=torch.tensor([ids], device=dev), output_hidden_states=True).hidden_states
                out.append(torch.cat([hs[j][0] for j in aux_ids], -1).float())
        return out, by_layer(len(seqs))

    def ours(m, dtype):
        routes.clear()
        aux, _ = lean_forward(m, seqs, aux_ids, dtype)
        bounds = torch.tensor([0] + list(lengths)).cumsum(0).tolist()
        return [aux[bounds[i]:bounds[i + 1]].float() for i in range(len(seqs))], list(routes)

    rel = lambda a, b: max(((x - y).norm() / y.norm()).item() for x, y in zip(a, b))  # noqa: E731
    rerouted = lambda a, b: sum((x != y).any(-1).sum().item() for x, y in zip(a, b)) / sum(len(x) for x in b)  # noqa: E731
    # float32: transformers' per-expert loop (its grouped_mm kernels are made for bf16); bf16 below: its default
    default_experts = base.config._experts_implementation
    base.set_experts_implementation("eager")
    ref, ref_routes = hf(base)
    base.set_experts_implementation(default_experts)
    mine, mine_routes = ours(base, torch.float32)
    res = {"arch": arch, "layers": layers, "tokens": sum(lengths), "ours_fp32_vs_hf_fp32": rel(mine, ref),
           "ours_fp32_rerouted": rerouted(mine_routes, ref_routes)}
    base = base.to(torch.bfloat16)
    mine, mine_routes = ours(base, torch.bfloat16)
    theirs, their_routes = hf(base)
    res["moe_path_bf16"] = moe_path(torch.device(dev), torch.bfloat16)
    res["hf_experts_bf16"] = base.config._experts_implementation
    res["ours_bf16_vs_hf_fp32"] = rel(mine, ref)
    res["hf_bf16_vs_hf_fp32"] = rel(theirs, ref)
    res["ours_bf16_vs_hf_bf16"] = rel(mine, theirs)  # what the full-model check compares (0.43 on DeepSeek-V3's shape)
    res["bf16_ratio"] = res["ours_bf16_vs_hf_fp32"] / res["hf_bf16_vs_hf_fp32"]
    # share of (token, MoE layer) routings that differ from the float32 forward's
    res["ours_bf16_rerouted"] = rerouted(mine_routes, ref_routes)
    res["hf_bf16_rerouted"] = rerouted(their_routes, ref_routes)
    res["pass"] = res["ours_fp32_vs_hf_fp32"] <= 1e-4 and res["bf16_ratio"] <= 1.5
    del base
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def int4_variant(base, samples, aux_ids, args, dev, out: Path, meta: dict) -> dict:
    """The same model with its routed experts in Kimi-K2's INT4 (compressed-tensors pack-quantized,
    group 32; `quantized.quantize_experts`), dequantized per layer in the forward: memory held and
    tokens/s beside the bf16 rows."""
    from eagle3_assets.core.quantized import Int4Group, held_bytes, quantize_experts

    res = {"bf16_held_bytes": held_bytes(base)}
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        res["bf16_cuda_allocated"] = torch.cuda.memory_allocated(dev)
    t0 = time.perf_counter()
    quantize_experts(base, Int4Group(32), experts_per_chunk=args.experts_per_chunk)
    sync(dev)
    res["quantize_s"] = time.perf_counter() - t0
    res["int4_held_bytes"] = held_bytes(base)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        res["int4_cuda_allocated"] = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    tokens = sum(len(s[1]) for s in samples)
    t = lean_no_save(base, samples, aux_ids, args.batch_tokens, dev)
    row("INT4 experts: engine forward only, no saving", tokens / t,
        f"{t:.1f} s, weights {res['int4_held_bytes'] / 1e9:.1f} GB held (bf16: {res['bf16_held_bytes'] / 1e9:.1f} GB)")
    d = reset_dir(out / "engine_int4")
    t0 = time.perf_counter()
    extract_samples(base, samples, d, aux_layer_ids=aux_ids, dtype=torch.bfloat16, batch_tokens=args.batch_tokens,
                    writer_threads=args.writer_threads, metadata=meta, staging_buffers=args.staging_buffers)
    t = time.perf_counter() - t0
    assert len(list(d.glob("*.safetensors"))) == len(samples)
    row("INT4 experts: our engine, files written", tokens / t, f"{t:.1f} s")
    shutil.rmtree(d, ignore_errors=True)
    if dev.type == "cuda":
        res["int4_cuda_peak"] = torch.cuda.max_memory_allocated(dev)
    log(f"INT4 variant: {json.dumps(res)}")
    return res


def load_test(model, d: Path, dev) -> dict:
    from transformers import AutoModel

    reset_dir(d)
    t0 = time.perf_counter()
    model.save_pretrained(d)
    os.sync()
    save_s = time.perf_counter() - t0
    files = list(d.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    for f in files:  # evict from the page cache: a cold read, as from a fresh node
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    res = {"checkpoint_bytes": size, "save_s": save_s}
    for kind in ("cold", "warm"):
        t0 = time.perf_counter()
        m = AutoModel.from_pretrained(d, dtype=torch.bfloat16, device_map=str(dev) if dev.type == "cuda" else None)
        sync(dev)
        res[f"load_{kind}_s"] = time.perf_counter() - t0
        del m
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    shutil.rmtree(d, ignore_errors=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="tiny model and samples (CPU smoke test)")
    ap.add_argument("--arch", choices=["llama", "qwen3_moe", "deepseek_v3"], default="llama",
                    help="the target: Llama-3.1-8B shape, or an MoE of >= 20B parameters (see the top of this file)")
    ap.add_argument("--padded-batch", type=int, default=8, help="rows per right-padded batch of the padded-batch rows")
    ap.add_argument("--samples", type=int, default=None, help="default 128 (llama), 48 (MoE)")
    ap.add_argument("--min-tokens", type=int, default=None, help="default 256 (16 tiny)")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 4096 (llama), 2048 (MoE); 256 tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default="/tmp/extract_bench")
    ap.add_argument("--json", default=None)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--writer-threads", type=int, default=4)
    ap.add_argument("--staging-buffers", type=int, default=3)
    ap.add_argument("--disk-gb", type=float, default=4.0)
    ap.add_argument("--load-test", action="store_true", help="save the model, time a cold and a warm load")
    ap.add_argument("--skip-peers", action="store_true")
    ap.add_argument("--skip-durable", action="store_true")
    ap.add_argument("--sweep", default="", help="comma-separated pack sizes: also time the lean forward at these")
    ap.add_argument("--model", help="a real target folder (with --generations): the engine on real shards' rows")
    ap.add_argument("--generations", help="comma-separated generations Parquet files (with --model)")
    ap.add_argument("--fp32-slice", action="store_true",
                    help="MoE: first compare a 4-layer float32 slice of the shape with transformers (issue 21, item 1)")
    ap.add_argument("--int4", action="store_true", help="MoE: last, the same model with INT4 experts (memory, tok/s)")
    ap.add_argument("--eager-baseline", action="store_true",
                    help="MoE: also time the forward with the elementwise steps eager (core/compiled.py off: before they were compiled)")
    ap.add_argument("--profile", default=None,
                    help="also profile 3 packs of the lean forward (torch.profiler): the kernels by device time, to this file")
    ap.add_argument("--experts-per-chunk", type=int, default=None, help="INT4: experts dequantized at a time (default all)")
    args = ap.parse_args()
    if args.model:
        return same_data_as_shards(args)

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    out = Path(args.out_dir)
    RESULTS["args"] = vars(args)
    if args.json:
        JSON_PATH.append(Path(args.json))
    RESULTS["device"] = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    RESULTS["date"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    RESULTS["versions"] = {"torch": torch.__version__, "python": sys.version.split()[0]}
    import transformers

    RESULTS["versions"]["transformers"] = transformers.__version__
    log(f"{RESULTS['date']}  device {RESULTS['device']}  torch {torch.__version__}  transformers {transformers.__version__}")

    moe = args.arch != "llama"
    if moe and args.fp32_slice:
        RESULTS["fp32_slice"] = slice_check(args.arch, dev, tiny=args.tiny)
        log(f"4-layer slice: {json.dumps(RESULTS['fp32_slice'])}")
        save_json()
    model = build_model(args.tiny, dev, args.arch)
    base = model.model
    n_layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    aux_ids = [2, n_layers // 2, n_layers - 3]
    dtype = torch.bfloat16
    lo = args.min_tokens or (16 if args.tiny else 256)
    hi = args.max_tokens or (256 if args.tiny else 2048 if moe else 4096)
    samples = make_samples(args.samples or (48 if moe else 128), lo, hi, model.config.vocab_size, args.seed)
    tokens = sum(len(s[1]) for s in samples)
    bpt = SampleLayout(hidden, dtype).bytes_per_token()
    RESULTS.update(samples=len(samples), tokens=tokens, mean_tokens=tokens / len(samples), bytes_per_token=bpt,
                   aux_layer_ids=aux_ids, lean_supported=lean_supported(base))
    log(f"{len(samples)} samples, {tokens:,} tokens (mean {tokens / len(samples):,.0f}, {lo}-{hi}), "
        f"{bpt:,} bytes/token, aux ids {aux_ids}, lean path: {lean_supported(base)}")

    # correctness on this device: engine files vs HF output_hidden_states, short samples packed together
    err = check_against_hf(model, samples, aux_ids, reset_dir(out / "check"), dtype, args.batch_tokens,
                           fp32=args.tiny or not moe)
    RESULTS["max_rel_err"] = err
    log("relative error, worst sample: engine bf16 files (packed) vs HF float32 {engine_vs_fp32:.2e}; "
        "HF's own bf16 run vs HF float32 {hf_bf16_vs_fp32:.2e}; engine vs HF bf16 {engine_vs_hf_bf16:.2e}".format(**err)
        + ("" if args.tiny or not moe else " (no float32 copy of this model fits: the first two are 0)"))

    # ceilings
    dense, attn = flops_per_token(model, samples)
    rate = matmul_ceiling(dev, args.tiny)
    RESULTS.update(matmul_flops_per_s=rate, flops_per_token_dense=dense, flops_per_token_attn=attn)
    row("compute ceiling (bf16 matmul, measured)", rate / (dense + attn),
        f"{rate / 1e12:,.0f} TFLOP/s / {(dense + attn) / 1e9:.2f} GFLOP/token")
    disk_bytes = int((0.1 if args.tiny else args.disk_gb) * 1e9)
    wbps = disk_ceiling(out / "disk_probe.bin", disk_bytes)
    RESULTS["disk_write_bytes_per_s"] = wbps
    row("disk ceiling (fsync'd sequential write, measured)", wbps / bpt, f"{wbps / 1e9:.2f} GB/s / {bpt:,} B/token")

    # the peers' way
    if not args.skip_peers:
        d = reset_dir(out / "peers")
        t = peers_way(model, samples, d, aux_ids, dev)
        row("peers' way: per sample, full LM + output_hidden_states, torch.save", tokens / t, f"{t:.1f} s")
        shutil.rmtree(d, ignore_errors=True)

    # no-saving references: what the forward alone can do
    t = hf_base_no_save(base, samples, aux_ids, dev)
    row("HF base model per sample + hooks, no saving", tokens / t, f"{t:.1f} s")
    if moe:
        t = hf_padded_no_save(base, samples, aux_ids, dev, args.padded_batch)
        row(f"HF base model, right-padded batches of {args.padded_batch}, no saving", tokens / t, f"{t:.1f} s")
    t = lean_no_save(base, samples, aux_ids, args.batch_tokens, dev)
    row(f"engine forward only (lean, packed {args.batch_tokens}), no saving", tokens / t, f"{t:.1f} s")
    if moe and args.eager_baseline:
        from eagle3_assets.core.compiled import Compiled

        Compiled.ok = False
        t = lean_no_save(base, samples, aux_ids, args.batch_tokens, dev)
        Compiled.ok = not Compiled.why
        row(f"engine forward only (lean, packed {args.batch_tokens}), elementwise steps eager, no saving",
            tokens / t, f"{t:.1f} s")
    if args.profile:
        from kernel_profile import profile_steps  # the training benchmark's kernel table, without the trainer's imports

        packs = plan_packs([len(s[1]) for s in samples], args.batch_tokens)[:3]
        profile_steps(f"{args.arch} lean forward, one pack of {args.batch_tokens}",
                      lambda p: lean_forward(base, [samples[i][1] for i in p], aux_ids, torch.bfloat16), packs, dev,
                      Path(args.profile))
    for bt in [int(x) for x in args.sweep.split(",") if x]:
        t = lean_no_save(base, samples, aux_ids, bt, dev)
        row(f"engine forward only (lean, packed {bt}), no saving", tokens / t, f"{t:.1f} s")

    # our engine, real files
    d = reset_dir(out / "engine")
    meta = {"format_version": "1", "target_model": "bench", "aux_layer_ids": ",".join(map(str, aux_ids)),
            "dtype": "bfloat16", "hidden_size": str(hidden)}
    t0 = time.perf_counter()
    extract_samples(base, samples, d, aux_layer_ids=aux_ids, dtype=dtype, batch_tokens=args.batch_tokens,
                    writer_threads=args.writer_threads, metadata=meta, staging_buffers=args.staging_buffers)
    t_files = time.perf_counter() - t0
    os.sync()
    t_synced = time.perf_counter() - t0
    files = sorted(d.glob("*.safetensors"))
    on_disk = sum(f.stat().st_size for f in files)
    assert len(files) == len(samples), (len(files), len(samples))
    assert not list(d.glob(".*")), "temporaries left"
    assert all(validate_sample(sample_file(d, s[0]), s[1], SampleLayout(hidden, dtype)) for s in samples[:8])
    RESULTS.update(engine_bytes_on_disk=on_disk, engine_files=len(files))
    row("OUR ENGINE: files written (closed + renamed)", tokens / t_files,
        f"{t_files:.1f} s, {on_disk / 1e9:.2f} GB, {on_disk / tokens:,.0f} B/token on disk")
    row("our engine incl. os.sync() (data on disk)", tokens / t_synced, f"{t_synced:.1f} s")
    shutil.rmtree(d, ignore_errors=True)
    if moe:  # the fallback tensor parallelism runs: transformers' forward over right-padded batches, files written
        d = reset_dir(out / "engine_padded")
        t0 = time.perf_counter()
        extract_samples(base, samples, d, aux_layer_ids=aux_ids, dtype=dtype, batch_tokens=args.batch_tokens,
                        writer_threads=args.writer_threads, metadata=meta, staging_buffers=args.staging_buffers, lean=False)
        t = time.perf_counter() - t0
        assert len(list(d.glob("*.safetensors"))) == len(samples)
        row(f"our engine, padded-batch fallback ({args.batch_tokens} padded tokens), files written", tokens / t, f"{t:.1f} s")
        shutil.rmtree(d, ignore_errors=True)
    if not args.skip_durable:  # each file fdatasync'd before its rename: the disk's pace, sustained
        d = reset_dir(out / "engine_fsync")
        t0 = time.perf_counter()
        extract_samples(base, samples, d, aux_layer_ids=aux_ids, dtype=dtype, batch_tokens=args.batch_tokens,
                        writer_threads=args.writer_threads, metadata=meta, staging_buffers=args.staging_buffers,
                        fsync=True)
        t_durable = time.perf_counter() - t0
        assert len(list(d.glob("*.safetensors"))) == len(samples)
        row("our engine, fsync=True (every file on disk before its rename)", tokens / t_durable, f"{t_durable:.1f} s")
        shutil.rmtree(d, ignore_errors=True)
    peers = RESULTS.get("peers' way: per sample, full LM + output_hidden_states, torch.save")
    if peers:
        RESULTS["speedup_vs_peers"] = (tokens / t_files) / peers["tokens_per_s"]

    if moe and args.int4:
        RESULTS["int4"] = int4_variant(base, samples, aux_ids, args, dev, out, meta)
        save_json()

    if args.load_test:
        lt = load_test(model, out / "ckpt", dev)
        shard_tokens = 2000 * RESULTS["mean_tokens"]
        lt["shard_2000_tokens"] = shard_tokens
        lt["shard_2000_extract_s"] = shard_tokens / (tokens / t_files)
        lt["shard_2000_extract_s_disk_bound"] = shard_tokens / min(tokens / t_files, wbps / bpt)
        lt["shard_2000_bytes"] = shard_tokens * bpt
        RESULTS["load"] = lt
        log(f"load: {json.dumps(lt)}")

    if moe:
        from eagle3_assets.core.compiled import compiled_path
        from eagle3_assets.core.moe import moe_path

        RESULTS["moe_path"] = moe_path(dev, dtype)  # grouped_mm, or the per-expert loop and why
        RESULTS["elementwise"] = compiled_path()  # compiled, or eager and why
        log(f"MoE experts: {RESULTS['moe_path']}, elementwise steps {RESULTS['elementwise']}")
    log("\n| way | tokens/s | note |\n| --- | ---: | --- |")
    for name, v, note in ROWS:
        log(f"| {name} | {v:,.0f} | {note} |")
    if "speedup_vs_peers" in RESULTS:
        log(f"engine / peers' way: {RESULTS['speedup_vs_peers']:.2f}x")
    padded = RESULTS.get(f"HF base model, right-padded batches of {args.padded_batch}, no saving")
    if padded:
        RESULTS["speedup_vs_padded_no_save"] = (tokens / t_files) / padded["tokens_per_s"]
        log(f"engine (files written) / padded-batch forward (nothing written): {RESULTS['speedup_vs_padded_no_save']:.2f}x "
            f"(issue 15's goal: >= 4x the peers' way and >= 1x this)")
    if "load" in RESULTS:
        lt = RESULTS["load"]
        log(f"model load: cold {lt['load_cold_s']:.1f} s, warm {lt['load_warm_s']:.1f} s "
            f"({lt['checkpoint_bytes'] / 1e9:.1f} GB); a 2,000-sample shard (~{lt['shard_2000_tokens'] / 1e6:.1f}M tokens, "
            f"{lt['shard_2000_bytes'] / 1e9:.0f} GB) extracts in ~{lt['shard_2000_extract_s']:.0f} s at the engine's rate, "
            f"~{lt['shard_2000_extract_s_disk_bound']:.0f} s if disk-bound")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(RESULTS, indent=2))


def same_data_as_shards(args) -> None:
    """The engine alone on a real target and real shards' rows: the rate `eagle3 run` should reach."""
    import polars as pl

    from eagle3_assets.core.target import load_model, pick_device

    dev = pick_device("auto")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    base = load_model(Path(args.model), dtype, str(dev), base_only=True)
    load_s = time.perf_counter() - t0
    cfg = base.config
    aux_ids = [2, cfg.num_hidden_layers // 2, cfg.num_hidden_layers - 3]
    out = Path(args.out_dir)
    RESULTS.update(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", model=args.model,
                   model_load_s=load_s, date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), shards={})
    log(f"{RESULTS['date']}  {RESULTS['device']}  {args.model} loaded in {load_s:.1f} s")
    t0 = time.perf_counter()
    warm_up(base, aux_ids, dtype)
    log(f"warm-up {time.perf_counter() - t0:.1f} s")
    meta = {"format_version": "1", "target_model": "bench", "aux_layer_ids": ",".join(map(str, aux_ids)),
            "dtype": str(dtype).removeprefix("torch."), "hidden_size": str(cfg.hidden_size)}
    for path in args.generations.split(","):
        df = pl.read_parquet(path, columns=["row_id", "input_ids", "loss_mask"])
        samples = [(r, list(i), list(m)) for r, i, m in df.iter_rows()]
        tokens = sum(len(x[1]) for x in samples)
        t = lean_no_save(base, samples, aux_ids, args.batch_tokens, dev)
        row(f"{Path(path).stem}: engine forward only (packed {args.batch_tokens}), no saving", tokens / t, f"{t:.2f} s")
        d = reset_dir(out / Path(path).stem)
        t0 = time.perf_counter()
        extract_samples(base, samples, d, aux_layer_ids=aux_ids, dtype=dtype, batch_tokens=args.batch_tokens,
                        writer_threads=args.writer_threads, metadata=meta, staging_buffers=args.staging_buffers)
        t = time.perf_counter() - t0
        assert len(list(d.glob("*.safetensors"))) == len(samples)
        row(f"{Path(path).stem}: ENGINE, files written", tokens / t, f"{len(samples)} samples, {tokens:,} tokens, {t:.2f} s")
        RESULTS["shards"][Path(path).stem] = {"samples": len(samples), "tokens": tokens, "engine_s": t}
        shutil.rmtree(d, ignore_errors=True)
    if moe:
        from eagle3_assets.core.compiled import compiled_path
        from eagle3_assets.core.moe import moe_path

        RESULTS["moe_path"] = moe_path(dev, dtype)  # grouped_mm, or the per-expert loop and why
        RESULTS["elementwise"] = compiled_path()  # compiled, or eager and why
        log(f"MoE experts: {RESULTS['moe_path']}, elementwise steps {RESULTS['elementwise']}")
    log("\n| way | tokens/s | note |\n| --- | ---: | --- |")
    for name, v, note in ROWS:
        log(f"| {name} | {v:,.0f} | {note} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(RESULTS, indent=2))


if __name__ == "__main__":
    main()
