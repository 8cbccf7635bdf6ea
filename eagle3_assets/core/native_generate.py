"""Native batched generation for Llama-family targets: continuous batching over per-slot KV caches.

transformers `generate` pads every row to its batch's longest prompt, concatenates its whole
cache every step and launches hundreds of kernels per step from Python. This engine runs the
model's own weights by hand (the same math as `lean_forward` in `hidden_states.py`):

- A fixed number of slots. One contiguous KV cache per layer, [slots, kv_heads, max_len,
  head_dim] for k and for v, allocated once; `max_len` is the job's longest prompt plus
  `max_new_tokens`. The slot count follows the memory left by the weights.
- Continuous batching: prompts sorted by length, longest first; every `refill_every` decode
  steps the host reads the slots' "active" flags (the only sync), collects the finished
  answers and fills the free slots by a batched, right-padded prefill that writes each prompt's
  k/v into its slot.
- Decode step: one token for every slot; each slot's attention reads only its live length.
  On CUDA a Triton kernel (split-K when there are few slots) and the whole step (embedding,
  layers, norm, lm_head, next token, EOS and length bookkeeping) captured in one CUDA graph
  over static buffers. On the CPU, and as the reference, the same step in eager PyTorch with
  masked SDPA over the cache up to the longest live length.
- Greedy is the argmax of the logits. Sampling (temperature, top-p) is Gumbel-max with noise
  hashed from (seed, row_id, answer position, vocab id) on the device, so a row's answer does
  not depend on its slot, its batch or the other rows.

`generate_native` returns each row's answer ids (up to and including the first EOS) and the
run's figures; `core/generate.py` turns them into the generations Parquet.
"""

from __future__ import annotations

import hashlib
import gc
import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

# Slot counts and budgets when the caller gives none. On the GPU the earlier measurement (191k
# tok/s at 1,024 slots, 256k at 2,048, SmolLM2 shape) says more slots keep paying up to a few
# thousand; past that the KV reads dominate and the tail of the run (too few prompts left to
# fill the slots) grows.
DEFAULT_SLOTS = {"cuda": 2048, "cpu": 8}
CPU_KV_BUDGET_BYTES = 1 << 30
PREFILL_TOKENS = {"cuda": 65536, "cpu": 2048}  # padded tokens per prefill forward
_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}  # cos/sin that depend on the position only
_M32 = 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------
# Which models


def _families() -> list[tuple]:
    """(CausalLM, DecoderLayer, RMSNorm, Attention, MLP) classes whose math this engine runs."""
    import importlib

    out = []
    for mod, name in (("llama", "Llama"), ("qwen2", "Qwen2"), ("qwen3", "Qwen3")):
        try:
            m = importlib.import_module(f"transformers.models.{mod}.modeling_{mod}")
        except ImportError:
            continue
        out.append(tuple(getattr(m, f"{name}{kind}") for kind in ("ForCausalLM", "DecoderLayer", "RMSNorm", "Attention", "MLP")))
    return out


def native_supported(model) -> tuple[bool, str]:
    """(True, "") when this engine computes exactly what the model's own forward does: a plain
    Llama, Qwen2 or Qwen3 (dense) causal LM, silu MLP, full attention in every layer, RoPE
    that depends on the position only, one device, no dispatch hooks."""
    family = next((f for f in _families() if type(model) is f[0]), None)
    if family is None:
        return False, f"{type(model).__name__} is not LlamaForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM"
    _, layer_cls, norm_cls, attn_cls, mlp_cls = family
    cfg = model.config
    if getattr(cfg, "hidden_act", None) != "silu":
        return False, f"hidden_act {getattr(cfg, 'hidden_act', None)!r} (only silu)"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return False, f"pretraining_tp {cfg.pretraining_tp} (only 1)"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return False, "sliding-window layers (only full attention)"
    if getattr(cfg, "use_sliding_window", False):
        return False, "use_sliding_window (only full attention)"
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in _ROPE_TYPES:
        return False, f"rope_type {rope!r} (supported: {sorted(_ROPE_TYPES)})"
    if any(hasattr(m, "_hf_hook") for m in model.modules()):
        return False, "the model has dispatch hooks (device_map offloading); load it onto one device"
    if len({p.device for p in model.parameters()}) != 1:
        return False, "the model's weights are on several devices; load it onto one device"
    base = model.model
    norms = [base.norm] + [n for l in base.layers for n in (l.input_layernorm, l.post_attention_layernorm)]
    if not all(type(l) is layer_cls and type(l.self_attn) is attn_cls and type(l.mlp) is mlp_cls for l in base.layers):
        return False, "the decoder layers are not the stock transformers modules"
    if not all(type(n) is norm_cls for n in norms):
        return False, "the norms are not the stock RMSNorm modules"
    return True, ""


# ---------------------------------------------------------------------------------------------
# The public entry point


@dataclass
class NativeResult:
    rows: list[tuple[int, list[int], bool]]  # (row_id, answer ids, finished), in input order
    prefill_s: float
    decode_s: float
    total_s: float  # wall time of the whole call: planning, allocation, graph capture included
    prompt_tokens: int
    answer_tokens: int
    decode_steps: int
    mean_occupancy: float  # active slots / slots, averaged over the decode steps
    slots: int
    kv_cache_bytes: int
    max_len: int
    cuda_graph: bool
    attention: str  # "triton" or "sdpa"
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        """Answer tokens per second of the whole call."""
        return self.answer_tokens / self.total_s if self.total_s > 0 else 0.0


def generate_native(
    model,
    prompts: list[tuple[int, list[int]]],
    *,
    eos_ids: list[int],
    max_new_tokens: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    max_slots: int | None = None,
    gpu_memory_fraction: float = 0.9,
    refill_every: int = 16,
    cuda_graph: bool = True,
    log=lambda msg: None,
    kv_budget_bytes: int | None = None,
    attention: str = "auto",
    prefill_tokens: int | None = None,
) -> NativeResult:
    """Answer `prompts` (row_id, templated prompt ids) with `model`'s greedy or sampled tokens.

    `max_slots` caps the number of sequences decoded at once (default: 2,048 on CUDA, 8 on the
    CPU; fewer when the KV cache would not fit). The cache may take `gpu_memory_fraction` of the
    card's memory, less what is already allocated (the weights); `kv_budget_bytes` sets the
    budget directly (on the CPU the default is 1 GiB). `cuda_graph=False` runs the decode step
    eagerly on CUDA; `attention` is "triton" (CUDA only, the default there), "sdpa" (the eager
    reference: masked SDPA over the cache; the default on the CPU) or "auto".
    Raises ValueError, before any work, for a prompt that cannot be answered: longer than the
    model's positions allow with `max_new_tokens`, or whose cache would not fit in one slot.
    """
    t_start = time.perf_counter()
    ok, why = native_supported(model)
    if not ok:
        raise ValueError(f"the native engine does not run this model: {why}; use the transformers engine")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if do_sample and not (temperature > 0 and 0 < top_p <= 1):
        raise ValueError(f"sampling needs temperature > 0 and 0 < top_p <= 1, got {temperature} and {top_p}")
    if refill_every < 1:
        raise ValueError(f"refill_every must be >= 1, got {refill_every}")
    device = next(model.parameters()).device
    kind = "cuda" if device.type == "cuda" else "cpu"
    if attention == "auto":
        attention = "triton" if kind == "cuda" else "sdpa"
    if attention not in ("triton", "sdpa") or (attention == "triton" and kind != "cuda"):
        raise ValueError(f"attention {attention!r}: use 'triton' (CUDA only) or 'sdpa'")
    use_graph = cuda_graph and kind == "cuda"
    if use_graph and attention != "triton":
        raise ValueError("the CUDA graph needs attention='triton' (SDPA's shape changes every step); pass cuda_graph=False")
    if not prompts:
        return NativeResult([], 0.0, 0.0, 0.0, 0, 0, 0, 0.0, 0, 0, 0, use_graph, attention)

    plan = _plan(model, prompts, max_new_tokens, max_slots, gpu_memory_fraction, kv_budget_bytes,
                 prefill_tokens or PREFILL_TOKENS[kind], 0 if not do_sample else 2 if top_p < 1 else 1)
    t_plan = time.perf_counter()
    log(f"native engine: {len(prompts)} prompts, {plan.slots} slots, max_len {plan.max_len}, KV cache "
        f"{plan.kv_bytes / 2**30:.2f} GiB, attention {attention}, CUDA graph {'on' if use_graph else 'off'}")

    with torch.inference_mode():
        eng = _Engine(model, plan, eos_ids, max_new_tokens, do_sample, temperature, top_p, attention)
        if kind == "cuda":
            torch.cuda.synchronize(device)
        t_alloc = time.perf_counter()
        if use_graph:
            eng.capture()
        if kind == "cuda":
            torch.cuda.synchronize(device)
        setup_s = time.perf_counter() - t_start  # planning, allocation and capture
        # its parts, so that the set-up of many calls (one per turn) can be traced to its cause
        setup_parts = {"plan_s": t_plan - t_start, "alloc_s": t_alloc - t_plan, "capture_s": t_start + setup_s - t_alloc}
        rows, stats = _run(eng, prompts, seed, refill_every, use_graph, log)
    total_s = time.perf_counter() - t_start
    answer_tokens = sum(len(a) for _, a, _ in rows)
    return NativeResult(
        rows=rows,
        prefill_s=stats["prefill_s"],
        decode_s=stats["decode_s"],
        total_s=total_s,
        prompt_tokens=sum(len(p) for _, p in prompts),
        answer_tokens=answer_tokens,
        decode_steps=stats["steps"],
        mean_occupancy=stats["occupancy"],
        slots=plan.slots,
        kv_cache_bytes=plan.kv_bytes,
        max_len=plan.max_len,
        cuda_graph=use_graph,
        attention=attention,
        extra={"prefills": stats["prefills"], "setup_s": setup_s, **setup_parts},
    )


# ---------------------------------------------------------------------------------------------
# Planning: every refusal happens here, before any allocation or forward


@dataclass
class _Plan:
    slots: int
    max_len: int
    kv_bytes: int
    prefill_tokens: int
    fuse: bool  # copy q/k/v and gate/up weights into one matrix each (fewer, larger matmuls)


def _plan(model, prompts, max_new_tokens, max_slots, fraction, kv_budget_bytes, prefill_tokens, sampler) -> _Plan:
    cfg = model.config
    device = next(model.parameters()).device
    kind = "cuda" if device.type == "cuda" else "cpu"
    limit = cfg.max_position_embeddings
    vocab = cfg.vocab_size
    for row_id, ids in prompts:
        if len(ids) == 0:
            raise ValueError(f"row {row_id}: empty prompt; every prompt needs at least one token")
        if len(ids) + max_new_tokens > limit:
            raise ValueError(
                f"row {row_id}: prompt of {len(ids)} tokens + max_new_tokens {max_new_tokens} = "
                f"{len(ids) + max_new_tokens} positions, more than the model's max_position_embeddings {limit}; "
                f"drop longer prompts (max_prompt_tokens) or lower max_new_tokens"
            )
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"row {row_id}: token id {max(ids) if max(ids) >= vocab else min(ids)} outside the vocab 0..{vocab - 1}")
    longest_row, longest = max(((r, len(ids)) for r, ids in prompts), key=lambda x: x[1])
    max_len = longest + max_new_tokens
    a = model.model.layers[0].self_attn
    head_dim, kv_heads = a.head_dim, cfg.num_key_value_heads
    item = next(model.parameters()).element_size()
    per_slot = cfg.num_hidden_layers * 2 * kv_heads * max_len * head_dim * item
    # Per-slot decode workspace: the logits and the sampler's temporaries over the vocab (int64
    # hashed noise when sampling, a sort with top-p; sampler 0 greedy, 1 sampling, 2 top-p),
    # the answer buffer, the hidden states.
    per_slot_work = vocab * (24, 64, 96)[sampler] + (max_new_tokens + 1) * 4 + 64 * cfg.hidden_size * item
    # One prefill forward: hidden, norm, q/k/v (GQA-expanded for SDPA), attention output, MLP.
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q_width = cfg.num_attention_heads * head_dim
    prefill_work = prefill_tokens * item * (4 * h + 5 * q_width + 2 * kv_heads * head_dim + 3 * inter)
    layers = model.model.layers
    fused_bytes = item * sum(
        l.self_attn.q_proj.weight.numel() + l.self_attn.k_proj.weight.numel() + l.self_attn.v_proj.weight.numel()
        + l.mlp.gate_proj.weight.numel() + l.mlp.up_proj.weight.numel()
        for l in layers
    )
    if kv_budget_bytes is not None:
        budget, where = int(kv_budget_bytes), f"kv_budget_bytes {int(kv_budget_bytes):,}"
        fuse = True
    elif kind == "cuda":
        # An earlier engine's cache (a turn, a shard before this one) is freed but still reserved by
        # the caching allocator and its graph pool, so the driver does not count it as free: hand it
        # back first, or every later call gets the 5-7 GiB the first one left (measured, multi-turn).
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        taken = torch.cuda.memory_allocated(device)
        room = min(fraction * total - taken, free - (1 << 30))
        fuse = fused_bytes <= 0.1 * room  # a copy of most weights: only where it is cheap
        budget = int(room - prefill_work - (fused_bytes if fuse else 0))
        where = (f"gpu_memory_fraction {fraction} of {total / 2**30:.1f} GiB, less {taken / 2**30:.2f} GiB already "
                 f"allocated (the weights) and {(prefill_work + fused_bytes * fuse) / 2**30:.2f} GiB of workspace")
    else:
        budget, where, fuse = CPU_KV_BUDGET_BYTES, f"the CPU budget of {CPU_KV_BUDGET_BYTES:,} bytes", True
    fits = budget // (per_slot + per_slot_work) if budget > 0 else 0
    if fits < 1:
        raise ValueError(
            f"row {longest_row}: its prompt of {longest} tokens + max_new_tokens {max_new_tokens} needs "
            f"{per_slot + per_slot_work:,} bytes for one slot's KV cache and workspace ({max_len} positions x "
            f"{per_slot // max_len:,} bytes), more than the {max(budget, 0):,} bytes available ({where}); "
            f"lower max_new_tokens, drop long prompts (max_prompt_tokens) or give the cache more memory"
        )
    slots = min(fits, max_slots or DEFAULT_SLOTS[kind], len(prompts))
    return _Plan(slots, max_len, slots * per_slot, max(prefill_tokens, longest), fuse)


# ---------------------------------------------------------------------------------------------
# The engine: weights, static buffers, prefill, decode step, CUDA graph


def _prefill_sdpa():
    """SDPA backends for prefill: not cuDNN's, which builds a plan for each new (batch, width)
    shape, and every refill brings new shapes (over a second per 8,000 prompts on an H200)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _rms(weight: torch.Tensor, eps: float, x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    # x * cos + rotate_half(x) * sin, with rotate_half(x) * sin == roll(x, D/2) * [-sin1, sin2]
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (lowbias32's shape) on int64 tensors holding values in [0, 2^32).
    Both multipliers are below 2^31, so no product overflows int64: same bits on CPU and GPU."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x446CA68B) & _M32
    return x ^ (x >> 16)


def row_key(seed: int, row_id: int) -> int:
    """The sampling key of one row: a function of (seed, row_id) only."""
    digest = hashlib.blake2b(f"{int(seed)}:{int(row_id)}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def pick_tokens(logits: torch.Tensor, keys: torch.Tensor, t: torch.Tensor, vocab_mix: torch.Tensor | None,
                do_sample: bool, temperature: float, top_p: float) -> torch.Tensor:
    """Next token per row from the logits [B, V]. Greedy: argmax. Sampling: the argmax of
    logits / temperature + Gumbel noise, within the top-p nucleus; the noise is hashed from the
    row's key, its answer position `t` and the vocab id, so it is the same in any batch."""
    if not do_sample:
        return logits.argmax(-1)
    z = logits.float() / temperature
    if top_p < 1.0:
        # Keep the most likely tokens until their mass reaches top_p (the first one always).
        sorted_z, order = z.sort(-1, descending=True)
        p = sorted_z.softmax(-1)
        drop_sorted = (p.cumsum(-1) - p) >= top_p
        z = z.masked_fill(torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted), float("-inf"))
    step = _hash32(keys ^ _hash32((t.to(torch.int64) * 0x9E3779B1 + 0x632BE5AB) & _M32))
    bits = _hash32(step[:, None] ^ vocab_mix[None, :])
    u = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # uniform in (0, 1)
    return (z - torch.log(-torch.log(u))).argmax(-1)


def vocab_mixes(vocab: int, device) -> torch.Tensor:
    return _hash32((torch.arange(vocab, dtype=torch.int64, device=device) * 0x61C88647 + 0x2545F491) & _M32)


class _Engine:
    """The model's weights arranged for decoding, the KV cache and the per-slot state."""

    def __init__(self, model, plan: _Plan, eos_ids, max_new_tokens, do_sample, temperature, top_p, attention):
        base = model.model
        cfg = model.config
        self.device = device = next(model.parameters()).device
        self.dtype = dtype = next(model.parameters()).dtype
        self.plan, self.attention = plan, attention
        self.n_new = max_new_tokens
        self.do_sample, self.temperature, self.top_p = do_sample, temperature, top_p
        a0 = base.layers[0].self_attn
        self.head_dim, self.scale = a0.head_dim, a0.scaling
        self.q_heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.embed = base.embed_tokens.weight
        self.norm = (base.norm.weight, base.norm.variance_epsilon)
        self.lm_head = model.lm_head.weight
        self.layers = [self._layer(l, plan.fuse) for l in base.layers]
        S, L, D = plan.slots, plan.max_len, self.head_dim

        # RoPE cos/sin for every position of the cache, from the model's own rotary module
        # (computed once: the supported rope types depend on the position only).
        pos = torch.arange(L, device=device)[None]
        cos, sin = base.rotary_emb(torch.empty(0, device=device, dtype=dtype), pos)
        half = D // 2
        self.cos = cos[0]
        self.sin_signed = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)

        # One allocation for the whole KV cache; per layer a contiguous [S, KVH, L, D] view.
        self.cache = torch.zeros((len(self.layers), 2, S, self.kv_heads, L, D), dtype=dtype, device=device)
        # Per-slot state, updated in place (the CUDA graph reads and writes these buffers).
        self.tok = torch.zeros(S, dtype=torch.int64, device=device)      # token fed this step
        self.pos = torch.zeros(S, dtype=torch.int64, device=device)      # its position (= cached length)
        self.n_gen = torch.zeros(S, dtype=torch.int32, device=device)    # answer tokens so far
        self.active = torch.zeros(S, dtype=torch.bool, device=device)
        self.eos_hit = torch.zeros(S, dtype=torch.bool, device=device)
        self.keys = torch.zeros(S, dtype=torch.int64, device=device)     # sampling key per row
        self.out = torch.zeros((S, max_new_tokens + 1), dtype=torch.int32, device=device)  # column N: trash
        self.out_base = torch.arange(S, device=device) * (max_new_tokens + 1)
        self.kv_base = (torch.arange(S, device=device)[:, None] * self.kv_heads
                        + torch.arange(self.kv_heads, device=device)[None, :]) * L  # [S, KVH] rows of a layer
        self.active_sum = torch.zeros((), dtype=torch.int64, device=device)
        self.eos = torch.tensor(sorted(set(eos_ids)) or [-1], dtype=torch.int64, device=device)
        self.vocab_mix = vocab_mixes(cfg.vocab_size, device) if do_sample else None
        self.graph = None
        self.split = None
        if attention == "triton":
            self._triton_setup()

    @staticmethod
    def _layer(l, fuse: bool) -> dict:
        a, m = l.self_attn, l.mlp
        w = {
            "ln1": (l.input_layernorm.weight, l.input_layernorm.variance_epsilon),
            "ln2": (l.post_attention_layernorm.weight, l.post_attention_layernorm.variance_epsilon),
            "o": (a.o_proj.weight, a.o_proj.bias),
            "down": (m.down_proj.weight, m.down_proj.bias),
            "q_norm": (a.q_norm.weight, a.q_norm.variance_epsilon) if hasattr(a, "q_norm") else None,
            "k_norm": (a.k_norm.weight, a.k_norm.variance_epsilon) if hasattr(a, "k_norm") else None,
        }
        qkv = [a.q_proj, a.k_proj, a.v_proj]
        gate_up = [m.gate_proj, m.up_proj]
        if fuse:  # one matmul each instead of three and two: fewer kernels per decode step
            def cat(mods):
                bias = None if mods[0].bias is None else torch.cat([x.bias for x in mods])
                return [(torch.cat([x.weight for x in mods]), bias)]
            w["qkv"], w["gate_up"] = cat(qkv), cat(gate_up)
        else:
            w["qkv"] = [(x.weight, x.bias) for x in qkv]
            w["gate_up"] = [(x.weight, x.bias) for x in gate_up]
        return w

    def _project(self, pairs, x) -> list[torch.Tensor]:
        outs = [F.linear(x, wt, b) for wt, b in pairs]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def _qkv(self, w, x, cos, sin_signed):
        """q [.., Hq, D], k and v [.., KVH, D] from the normed hidden states x [.., H], RoPE applied."""
        D, hq = self.head_dim, self.q_heads
        qkv = self._project(w["qkv"], x)
        qk, v = qkv.split([(hq + self.kv_heads) * D, self.kv_heads * D], dim=-1)
        qk, v = qk.unflatten(-1, (-1, D)), v.unflatten(-1, (-1, D))
        if w["q_norm"] is not None:  # Qwen3: RMSNorm over each head before RoPE
            qk = torch.cat((_rms(*w["q_norm"], qk[..., :hq, :]), _rms(*w["k_norm"], qk[..., hq:, :])), dim=-2)
        qk = _rope(qk, cos, sin_signed)  # q and k together: half the kernels
        return qk[..., :hq, :], qk[..., hq:, :], v

    def _mlp(self, w, h):
        x = _rms(*w["ln2"], h)
        gate, up = self._project(w["gate_up"], x).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, *w["down"])

    def _logits(self, h):
        # lm_head in the model's dtype, as transformers; pick_tokens converts to float32 where
        # it samples (greedy's argmax is the same on either).
        return F.linear(_rms(*self.norm, h), self.lm_head)

    # -- prefill ----------------------------------------------------------------------------

    def prefill(self, slots: list[int], seqs: list[list[int]], keys: list[int]) -> None:
        """Run the prompts (right-padded into one batch), write their k/v into their slots'
        caches, pick each one's first answer token and arm the slots."""
        dev, B = self.device, len(seqs)
        T = max(len(s) for s in seqs)
        ids = torch.zeros((B, T), dtype=torch.int64)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
        lens = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
        ids, lens = ids.to(dev, non_blocking=True), lens.to(dev, non_blocking=True)
        slot_t = torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=True)
        cos, sin_signed = self.cos[:T, None, :], self.sin_signed[:T, None, :]  # [T, 1, D]
        h = F.embedding(ids, self.embed)  # [B, T, H]
        gqa = self.q_heads != self.kv_heads
        for i, w in enumerate(self.layers):
            q, k, v = self._qkv(w, _rms(*w["ln1"], h), cos, sin_signed)  # [B, T, heads, D]
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
            # Right padding: every real position's causal context holds only real tokens.
            # The padded tail is written to the cache too; decoding overwrites it before reading.
            self.cache[i, 0][slot_t, :, :T] = k
            self.cache[i, 1][slot_t, :, :T] = v
            with _prefill_sdpa():
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=gqa)
            h = h + F.linear(o.transpose(1, 2).flatten(2), *w["o"])
            h = h + self._mlp(w, h)
        last = h[torch.arange(B, device=dev), lens - 1]  # [B, H]
        key_t = torch.tensor(keys, dtype=torch.int64).to(dev, non_blocking=True)
        first = pick_tokens(self._logits(last), key_t, torch.zeros(B, dtype=torch.int64, device=dev),
                            self.vocab_mix, self.do_sample, self.temperature, self.top_p)
        is_eos = (first[:, None] == self.eos[None, :]).any(-1)
        self.tok.index_copy_(0, slot_t, first)
        self.pos.index_copy_(0, slot_t, lens)
        self.n_gen.index_fill_(0, slot_t, 1)
        self.out[:, 0].index_copy_(0, slot_t, first.to(torch.int32))
        self.eos_hit.index_copy_(0, slot_t, is_eos)
        self.active.index_copy_(0, slot_t, ~is_eos & (self.n_new > 1))
        self.keys.index_copy_(0, slot_t, key_t)

    # -- decode -----------------------------------------------------------------------------

    def step(self, span: int | None = None) -> None:
        """One token for every slot. `span` (eager SDPA only) is an upper bound of the live
        lengths, known on the host without a sync; the Triton kernel reads them on the device."""
        S, D = self.plan.slots, self.head_dim
        h = F.embedding(self.tok, self.embed)  # [S, H]
        cos, sin_signed = self.cos[self.pos][:, None, :], self.sin_signed[self.pos][:, None, :]  # [S, 1, D]
        live = self.pos + 1
        rows = (self.kv_base + self.pos[:, None]).flatten()  # where this step's k/v go, per layer
        if self.attention == "sdpa":
            mask = (torch.arange(span, device=self.device)[None, :] < live[:, None])[:, None, None, :]
        for i, w in enumerate(self.layers):
            q, k, v = self._qkv(w, _rms(*w["ln1"], h), cos, sin_signed)  # [S, heads, D]
            kc, vc = self.cache[i, 0], self.cache[i, 1]  # [S, KVH, L, D]
            kc.view(-1, D).index_copy_(0, rows, k.reshape(-1, D))
            vc.view(-1, D).index_copy_(0, rows, v.reshape(-1, D))
            if self.attention == "triton":
                o = self._attend_triton(q, kc, vc, live)
            else:
                o = F.scaled_dot_product_attention(
                    q[:, :, None, :], kc[:, :, :span], vc[:, :, :span], attn_mask=mask, scale=self.scale,
                    enable_gqa=self.q_heads != self.kv_heads,
                )[:, :, 0]
            h = h + F.linear(o.reshape(S, -1), *w["o"])
            h = h + self._mlp(w, h)
        nxt = pick_tokens(self._logits(h), self.keys, self.n_gen, self.vocab_mix, self.do_sample,
                          self.temperature, self.top_p)
        # Bookkeeping on the device: record the token, stop at EOS or at max_new_tokens.
        act = self.active
        col = torch.where(act, self.n_gen, self.n_new)  # finished and empty slots write the trash column
        self.out.view(-1).index_copy_(0, self.out_base + col, nxt.to(torch.int32))
        self.n_gen.add_(act.to(torch.int32))
        eos = (nxt[:, None] == self.eos[None, :]).any(-1) & act
        self.eos_hit.logical_or_(eos)
        ended = eos | (self.n_gen >= self.n_new)
        self.pos.add_((act & ~ended).to(torch.int64))
        self.tok.copy_(nxt)
        self.active_sum.add_(act.sum())
        self.active.logical_and_(~ended)

    # -- CUDA: Triton attention and the graph ------------------------------------------------

    def _triton_setup(self) -> None:
        S, D, L = self.plan.slots, self.head_dim, self.plan.max_len
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        block_n = 64
        # Split each slot's keys when slots x kv heads alone leave the SMs idle (flash-decoding).
        splits = max(1, min(_ceil_div(2 * sms, S * self.kv_heads), _ceil_div(L, block_n), 32))
        self.split = {
            "n": splits,
            "len": _ceil_div(_ceil_div(L, splits), block_n) * block_n,  # keys per split, a multiple of block_n
            "block_n": block_n,
            "m": torch.empty((S, self.q_heads, splits), dtype=torch.float32, device=self.device),
            "l": torch.empty((S, self.q_heads, splits), dtype=torch.float32, device=self.device),
            "acc": torch.empty((S, self.q_heads, splits, D), dtype=torch.float32, device=self.device),
        }
        _triton_kernels()  # import triton and define the kernels now, not inside the capture

    def _attend_triton(self, q, kc, vc, live) -> torch.Tensor:
        kern = _triton_kernels()
        sp = self.split
        S, D = q.shape[0], self.head_dim
        o = torch.empty((S, self.q_heads, D), dtype=q.dtype, device=q.device)
        group = self.q_heads // self.kv_heads
        block_g = max(16, triton_next_pow2(group))
        block_d = max(16, triton_next_pow2(D))
        kern["decode"][(S, self.kv_heads, sp["n"])](
            q, kc, vc, live, o, sp["m"], sp["l"], sp["acc"],
            q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
            vc.stride(0), vc.stride(1), vc.stride(2), o.stride(0), o.stride(1),
            self.scale, sp["len"], self.q_heads,
            G=group, BLOCK_G=block_g, BLOCK_N=sp["block_n"], D=D, BLOCK_D=block_d, NSPLIT=sp["n"],
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        )
        if sp["n"] > 1:
            kern["reduce"][(S, self.q_heads)](
                sp["m"], sp["l"], sp["acc"], o, o.stride(0), o.stride(1), self.q_heads,
                NSPLIT=sp["n"], BLOCK_S=triton_next_pow2(sp["n"]), D=D, BLOCK_D=block_d,
            )
        return o

    def capture(self) -> None:
        """Capture one decode step in a CUDA graph. Runs before any slot is filled: the warm-up
        steps (which compile the kernels) see only inactive slots and change nothing that counts."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.step()
        self.active_sum.zero_()

    def replay(self) -> None:
        self.graph.replay()


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


# ---------------------------------------------------------------------------------------------
# The loop: refill, decode, harvest


def _run(eng: _Engine, prompts, seed: int, refill_every: int, use_graph: bool, log):
    t0 = time.perf_counter()
    S, N = eng.plan.slots, eng.n_new
    period = min(refill_every, N)  # no slot stays active longer than N - 1 steps
    cuda = eng.device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(eng.device)

    # Longest first: a refill batch holds prompts of similar lengths (little padding), and the
    # short ones at the end leave a short tail.
    pending = deque(sorted(range(len(prompts)), key=lambda i: -len(prompts[i][1])))
    free = list(range(S))
    busy: dict[int, tuple[int, int, int]] = {}  # slot -> (prompt index, prompt length, step filled)
    results: list = [None] * len(prompts)
    prefill_s = decode_s = 0.0
    steps = prefills = done = 0
    last_log = time.perf_counter()
    while pending or busy:
        # The only host sync of the loop: which slots have finished.
        if busy:
            t = time.perf_counter()
            active = eng.active.cpu().tolist()
            decode_s += time.perf_counter() - t
            finished = [s for s in busy if not active[s]]
            if finished:
                idx = torch.tensor(finished, device=eng.device)
                counts = eng.n_gen[idx].cpu().tolist()
                eos = eng.eos_hit[idx].cpu().tolist()
                answers = eng.out[idx, :N].cpu().tolist()
                for s, n, e, ans in zip(finished, counts, eos, answers):
                    i = busy.pop(s)[0]
                    results[i] = (prompts[i][0], ans[:n], bool(e))
                    free.append(s)
                done += len(finished)
        if pending and free:
            t = time.perf_counter()
            take = [pending.popleft() for _ in range(min(len(free), len(pending)))]
            slots = [free.pop() for _ in take]
            budget = eng.plan.prefill_tokens
            start = 0
            while start < len(take):
                # Chunks of at most `prefill_tokens` padded tokens, at most a quarter of them
                # padding (longest first: the first prompt sets the width).
                end, width = start + 1, len(prompts[take[start]][1])
                real = width
                while end < len(take) and (end - start + 1) * width <= budget:
                    n = len(prompts[take[end]][1])
                    if (end - start + 1) * width - (real + n) > 0.25 * (end - start + 1) * width:
                        break
                    end, real = end + 1, real + n
                eng.prefill(slots[start:end], [prompts[i][1] for i in take[start:end]],
                            [row_key(seed, prompts[i][0]) for i in take[start:end]])
                prefills += 1
                start = end
            for s, i in zip(slots, take):
                busy[s] = (i, len(prompts[i][1]), steps)
            sync()
            prefill_s += time.perf_counter() - t
        if not busy:
            break
        t = time.perf_counter()
        for _ in range(period):
            if use_graph:
                eng.replay()
            else:
                span = min(eng.plan.max_len, max(plen + steps - filled + 1 for _, plen, filled in busy.values()))
                eng.step(span)
            steps += 1
        decode_s += time.perf_counter() - t
        if time.perf_counter() - last_log > 10:
            last_log = time.perf_counter()
            log(f"native engine: {done}/{len(prompts)} rows done, {steps} decode steps, "
                f"{last_log - t0:.0f} s")
    sync()
    occupancy = eng.active_sum.item() / (steps * S) if steps else 0.0
    return results, {"prefill_s": prefill_s, "decode_s": decode_s, "steps": steps, "occupancy": occupancy,
                     "prefills": prefills}


# ---------------------------------------------------------------------------------------------
# Triton kernels (CUDA only; triton ships with CUDA builds of torch and is imported on first use)

_KERNELS: dict = {}


def _triton_kernels() -> dict:
    if _KERNELS:
        return _KERNELS
    import triton
    import triton.language as tl

    @triton.jit
    def decode_attention(
        Q, K, V, LIVE, O, PM, PL, PACC,
        stride_qs, stride_qh, stride_ks, stride_kh, stride_kl, stride_vs, stride_vh, stride_vl,
        stride_os, stride_oh, scale, split_len, HQ,
        G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
        BLOCK_D: tl.constexpr, NSPLIT: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """One (slot, kv head, split): the G query heads sharing that kv head attend over the
        slot's keys [split start, min(split end, live length)), online softmax in float32."""
        s = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        live = tl.load(LIVE + s).to(tl.int32)
        lo = sp * split_len
        hi = tl.minimum(lo + split_len, live)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        n = tl.arange(0, BLOCK_N)
        gmask = g < G
        dmask = d < D
        heads = kvh * G + g
        q = tl.load(Q + s * stride_qs + heads[:, None] * stride_qh + d[None, :],
                    mask=gmask[:, None] & dmask[None, :], other=0.0)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        k_base = K + s * stride_ks + kvh * stride_kh
        v_base = V + s * stride_vs + kvh * stride_vh
        for start in range(lo, hi, BLOCK_N):
            pos = start + n
            nmask = pos < hi
            kv_mask = nmask[:, None] & dmask[None, :]
            k = tl.load(k_base + pos[:, None] * stride_kl + d[None, :], mask=kv_mask, other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_G, BLOCK_N]
            qk = tl.where(nmask[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + pos[:, None] * stride_vl + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        if NSPLIT == 1:
            out = acc / l_i[:, None]
            tl.store(O + s * stride_os + heads[:, None] * stride_oh + d[None, :], out.to(O.dtype.element_ty),
                     mask=gmask[:, None] & dmask[None, :])
        else:  # partial results; an empty split leaves m = -inf, l = 0, acc = 0
            row = (s * HQ + heads) * NSPLIT + sp
            tl.store(PM + row, m_i, mask=gmask)
            tl.store(PL + row, l_i, mask=gmask)
            tl.store(PACC + row[:, None] * D + d[None, :], acc, mask=gmask[:, None] & dmask[None, :])

    @triton.jit
    def reduce_splits(
        PM, PL, PACC, O, stride_os, stride_oh, HQ,
        NSPLIT: tl.constexpr, BLOCK_S: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """Combine one (slot, query head)'s split partials: rescale each by exp(m - max m)."""
        s = tl.program_id(0)
        h = tl.program_id(1)
        j = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        jmask = j < NSPLIT
        dmask = d < D
        row = (s * HQ + h) * NSPLIT + j
        m = tl.load(PM + row, mask=jmask, other=float("-inf"))
        l = tl.load(PL + row, mask=jmask, other=0.0)
        acc = tl.load(PACC + row[:, None] * D + d[None, :], mask=jmask[:, None] & dmask[None, :], other=0.0)
        w = tl.exp(m - tl.max(m, 0))  # split 0 always holds key 0, so the max is finite
        out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
        tl.store(O + s * stride_os + h * stride_oh + d, out.to(O.dtype.element_ty), mask=dmask)

    _KERNELS.update(decode=decode_attention, reduce=reduce_splits)
    return _KERNELS
