"""The lean forward: a target's base model over samples packed end to end, by hand.

Token-wise ops (norms, projections, MLP, MoE routing and experts) see the whole pack as one
matrix; attention runs per sample (causal, positions restart at 0), so each sample's rows
equal an unbatched run, with no padding anywhere. It reads the model's own weights and calls
the model's own MoE blocks, so it needs the plain Hugging Face modules on one device
(`lean_supported`). Families:

- Llama, Qwen2 (biases on q/k/v), Qwen3 (an RMSNorm over each head of q and k before RoPE):
  grouped-query attention;
- Qwen3-MoE: Qwen3's attention, and the sparse MoE on the pack's [N, H] rows (`moe.py`: the
  model's own router, the experts as grouped GEMMs): routing is per token, so packing changes nothing;
- DeepSeek-V3 (and Kimi-K2, its architecture): multi-head latent attention, decompressed per
  token into full heads (a value head narrower than the query/key head), the MoE with its
  shared experts.

Quantized checkpoints (`quantized.py`: INT4 experts, FP8 blocks) run the same code: each
quantized weight is dequantized just before its matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .compiled import compiled
from .moe import moe_block
from .quantized import QuantExperts, QuantLinear


@dataclass(frozen=True)
class Family:
    """The transformers classes of one architecture that the lean forward knows how to read."""

    model: type
    layer: type
    norm: type
    mlp: type  # the dense gated MLP (gate/up/down), computed by hand
    moe: type | None  # the sparse MoE block, called as it is
    attention: str  # "gqa" or "mla"


def families() -> list[Family]:
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds
    from transformers.models.llama import modeling_llama as llama
    from transformers.models.qwen2 import modeling_qwen2 as qwen2
    from transformers.models.qwen3 import modeling_qwen3 as qwen3
    from transformers.models.qwen3_moe import modeling_qwen3_moe as qmoe

    return [
        Family(llama.LlamaModel, llama.LlamaDecoderLayer, llama.LlamaRMSNorm, llama.LlamaMLP, None, "gqa"),
        Family(qwen2.Qwen2Model, qwen2.Qwen2DecoderLayer, qwen2.Qwen2RMSNorm, qwen2.Qwen2MLP, None, "gqa"),
        Family(qwen3.Qwen3Model, qwen3.Qwen3DecoderLayer, qwen3.Qwen3RMSNorm, qwen3.Qwen3MLP, None, "gqa"),
        Family(qmoe.Qwen3MoeModel, qmoe.Qwen3MoeDecoderLayer, qmoe.Qwen3MoeRMSNorm, qmoe.Qwen3MoeMLP,
               qmoe.Qwen3MoeSparseMoeBlock, "gqa"),
        Family(ds.DeepseekV3Model, ds.DeepseekV3DecoderLayer, ds.DeepseekV3RMSNorm, ds.DeepseekV3MLP, ds.DeepseekV3MoE,
               "mla"),
    ]


def family_of(base_model) -> Family | None:
    return next((f for f in families() if type(base_model) is f.model), None)


def lean_supported(base_model) -> bool:
    """True for a plain Hugging Face base model of a known family (`families`) on one device, with
    no dispatch hooks, unquantized linear layers, SiLU MLPs and full (not sliding-window) attention."""
    fam = family_of(base_model)
    cfg = base_model.config
    if fam is None or getattr(cfg, "hidden_act", None) != "silu" or getattr(cfg, "quantization_config", None):
        return False
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return False
    if any(hasattr(m, "_hf_hook") for m in base_model.modules()):
        return False
    if len({p.device for p in base_model.parameters()}) != 1:
        return False
    # A quantized or otherwise replaced projection would be misread by F.linear on its .weight
    # (ours, `QuantLinear`, is dequantized by `_linear`).
    if any("Linear" in type(m).__name__ and type(m) not in (torch.nn.Linear, QuantLinear) for m in base_model.modules()):
        return False
    if fam.moe is not None and any(type(layer.mlp) is fam.moe and not _plain_experts(layer.mlp.experts)
                                   for layer in base_model.layers):
        return False
    norms = [base_model.norm]
    for layer in base_model.layers:
        a = layer.self_attn
        if type(layer) is not fam.layer or type(layer.mlp) not in (fam.mlp, fam.moe):
            return False
        if getattr(a, "sliding_window", None) is not None:  # our attention is full causal
            return False
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [n for n in (getattr(a, k, None) for k in ("q_norm", "k_norm", "q_a_layernorm", "kv_a_layernorm")) if n is not None]
    return all(type(n) is fam.norm for n in norms)


@dataclass(frozen=True)
class Packing:
    """Where each sample of a pack starts and ends: Python bounds for the per-sample path, and
    the cumulative lengths (int32, on the device) that a variable-length kernel reads."""

    bounds: list[tuple[int, int]]
    cu_seqlens: torch.Tensor
    max_len: int

    @classmethod
    def of(cls, bounds: list[tuple[int, int]], device) -> "Packing":
        cu = torch.tensor([0] + [e for _, e in bounds], dtype=torch.int32)
        if device.type == "cuda":
            cu = cu.pin_memory().to(device, non_blocking=True)
        return cls(bounds, cu, max(e - s for s, e in bounds))


class _Varlen:
    """Whether the one-call variable-length kernel (FlashAttention's varlen forward, as ATen ships
    it) runs here; switched off for good, with the reason, the first time it fails."""

    ok = True
    why = ""


def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing, scale: float):
    """Causal attention of every sample of a pack with itself: q and k [N, Hq|Hkv, D], v [N, Hkv, Dv]
    -> [N, Hq, Dv]. On CUDA in bf16/fp16 one FlashAttention varlen call does every sample (GQA
    included); elsewhere one SDPA call per sample, which for a pack of a few hundred short
    samples costs far more in launches than in arithmetic."""
    dv = v.shape[-1]
    if len(packing.bounds) > 1 and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and _Varlen.ok:
        try:
            # FlashAttention wants one head size: MLA's narrower value heads are padded with zeros,
            # which adds zero columns to the output (sliced off).
            v_ = F.pad(v, (0, q.shape[-1] - dv)) if dv != q.shape[-1] else v
            return torch.ops.aten._flash_attention_forward(
                q, k, v_, packing.cu_seqlens, packing.cu_seqlens, packing.max_len, packing.max_len, 0.0, True, False,
                scale=scale,
            )[0][..., :dv]
        except (RuntimeError, TypeError, AttributeError, NotImplementedError) as e:  # an older or other build
            _Varlen.ok, _Varlen.why = False, f"{type(e).__name__}: {e}"
    gqa = q.shape[1] != k.shape[1]
    out = q.new_empty(q.shape[0], q.shape[1], dv)
    for s, e in packing.bounds:
        out[s:e] = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1)[None], k[s:e].transpose(0, 1)[None], v[s:e].transpose(0, 1)[None],
            is_causal=True, scale=scale, enable_gqa=gqa,
        )[0].transpose(0, 1)
    return out


def attention_path(device: torch.device, dtype: torch.dtype) -> str:
    """How packs are attended here (after a first forward has tried the varlen kernel)."""
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and _Varlen.ok:
        return "flash_varlen"
    return "per_sample_sdpa" + (f" ({_Varlen.why})" if _Varlen.why else "")


def _rms(norm, x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


def _add_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, the RMSNorm of h + delta): the residual add and the norm after it."""
    h = h + delta
    return h, F.rms_norm(h, (h.shape[-1],), weight, eps)


def _residual(h: torch.Tensor, delta: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]:
    """`_add_norm` with the norm module's weight: on CUDA for rows at least ADD_NORM_COMPILED_WIDTH
    wide, one compiled kernel that reads each row once (eager: an add, then the norm's own pass; 8%
    of the Qwen3-MoE shape's forward on an H100)."""
    args = (h, delta, norm.weight, norm.variance_epsilon)
    if h.is_cuda and h.shape[-1] >= ADD_NORM_COMPILED_WIDTH:
        y = compiled(_add_norm, *args)
        if y is not None:
            return y
    return _add_norm(*args)


# As ROPE_COMPILED_WIDTH: wide targets' hidden rows (Qwen3-MoE's 2,048, DeepSeek-V3's 7,168); SmolLM2's
# 576 stays eager, where the compile's seconds would not pay.
ADD_NORM_COMPILED_WIDTH = 2048


def _plain_experts(experts) -> bool:
    """Experts `moe.routed_experts` reads: ours quantized, or transformers' fused gated SiLU ones."""
    if isinstance(experts, QuantExperts):
        return True
    from .quantized import _is_experts

    return _is_experts(experts) and getattr(experts, "has_gate", True) and not getattr(experts, "_is_expert_parallel", False)


def _linear(proj, x: torch.Tensor) -> torch.Tensor:
    if type(proj) is QuantLinear:
        return F.linear(x, proj.dequantized(x.dtype), proj.bias)
    return F.linear(x, proj.weight, proj.bias)


@dataclass(frozen=True)
class _Rope:
    """RoPE at the pack's positions: cos and sin [N, 1, D] from the model's own rotary embedding
    (its scaling, e.g. YaRN or Llama-3, included)."""

    cos: torch.Tensor
    sin_signed: torch.Tensor  # [-sin1, sin2]: rotate_half(x) * sin == roll(x, D/2) * sin_signed
    interleaved: bool = False  # DeepSeek's pairs (x0, x1), (x2, x3), ...

    @classmethod
    def at(cls, rotary_emb, h: torch.Tensor, positions: torch.Tensor, interleaved: bool = False) -> "_Rope":
        cos, sin = rotary_emb(h, positions[None])
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]
        half = sin.shape[-1] // 2
        return cls(cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1), interleaved)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.shape[-2] * x.shape[-1] >= ROPE_COMPILED_WIDTH:
            y = compiled(_rotate, x, self.cos, self.sin_signed, self.interleaved)
            if y is not None:
                return y
        return _rotate(x, self.cos, self.sin_signed, self.interleaved)


# RoPE compiled into one pass (eager: a product, a roll, an addcmul) for rotations at least this
# wide a token: Llama-8B's and Qwen3-MoE's queries (4,096 values; 11% of the Qwen3-MoE shape's forward
# eager, on an H100). Narrower ones (SmolLM2's 576) stay eager: the compile's seconds would not pay.
ROPE_COMPILED_WIDTH = 2048


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:  # de-interleave, then the half-split rotation (what transformers computes)
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)


def _gqa_attention(a, x: torch.Tensor, rope: _Rope, packing: Packing) -> torch.Tensor:
    """Llama / Qwen2 / Qwen3(-MoE) self-attention of a pack: [N, H] -> [N, H]."""
    n, d = x.shape[0], a.head_dim
    q = _linear(a.q_proj, x).view(n, -1, d)
    k = _linear(a.k_proj, x).view(n, -1, d)
    v = _linear(a.v_proj, x).view(n, -1, d)
    if getattr(a, "q_norm", None) is not None:  # Qwen3: each head normalized before RoPE
        q, k = _rms(a.q_norm, q), _rms(a.k_norm, k)
    o = packed_causal_attention(rope(q), rope(k), v, packing, a.scaling)
    return _linear(a.o_proj, o.view(n, -1))


def _mla_attention(a, x: torch.Tensor, rope: _Rope, packing: Packing) -> torch.Tensor:
    """DeepSeek-V3 multi-head latent attention of a pack: [N, H] -> [N, H]. The latent is
    decompressed per token into full keys and values (all token-wise), then attended as
    ordinary multi-head attention whose value heads are narrower than its query/key heads."""
    n, nope, rot = x.shape[0], a.qk_nope_head_dim, a.qk_rope_head_dim
    if a.q_lora_rank is None:
        q = _linear(a.q_proj, x)
    else:
        q = _linear(a.q_b_proj, _rms(a.q_a_layernorm, _linear(a.q_a_proj, x)))
    q = q.view(n, -1, nope + rot)
    latent, k_rot = _linear(a.kv_a_proj_with_mqa, x).split([a.kv_lora_rank, rot], dim=-1)
    kv = _linear(a.kv_b_proj, _rms(a.kv_a_layernorm, latent)).view(n, -1, nope + a.v_head_dim)
    heads = kv.shape[1]
    k = kv.new_empty(n, heads, nope + rot)
    k[..., :nope] = kv[..., :nope]
    k[..., nope:] = rope(k_rot.view(n, 1, rot))  # one rotary key, shared by every head
    q = torch.cat((q[..., :nope], rope(q[..., nope:])), dim=-1)
    o = packed_causal_attention(q, k, kv[..., nope:], packing, a.scaling)
    return _linear(a.o_proj, o.reshape(n, -1))


def _mlp(mlp, fam: Family, x: torch.Tensor) -> torch.Tensor:
    """The layer's feed-forward on a pack: the dense gated MLP by hand (in place, one [N, I]
    buffer), an MoE block by `moe.moe_block` (the model's router, grouped GEMMs over the
    experts, the shared experts by this function), which is token-wise."""
    if type(mlp) is not fam.mlp:
        return moe_block(mlp, x, lambda shared, rows: _mlp(shared, fam, rows))
    g = F.silu(_linear(mlp.gate_proj, x))
    g = g.mul_(_linear(mlp.up_proj, x))
    return _linear(mlp.down_proj, g)


@torch.inference_mode()
def lean_forward(base_model, seqs: list[list[int]], layer_ids: list[int], dtype: torch.dtype):
    """The base model over samples packed end to end; returns (aux [N, k*H], last [N, H]) in
    `dtype`, rows in `seqs` order. Token-wise ops see the whole pack; attention runs per
    sample (causal, positions restart at 0), so each sample's rows equal an unbatched run."""
    m = base_model
    fam = family_of(m)
    device = next(m.parameters()).device
    cuda = device.type == "cuda"
    flat = [t for s in seqs for t in s]
    pos = [p for s in seqs for p in range(len(s))]
    ids = torch.tensor(flat, dtype=torch.long)
    positions = torch.tensor(pos, dtype=torch.long)
    if cuda:
        ids, positions = ids.pin_memory().to(device, non_blocking=True), positions.pin_memory().to(device, non_blocking=True)
    n_tok = len(flat)
    bounds, off = [], 0
    for s in seqs:
        bounds.append((off, off + len(s)))
        off += len(s)
    packing = Packing.of(bounds, device)
    num_layers = len(m.layers)
    hidden = m.config.hidden_size
    slots: dict[int, list[int]] = {}
    for k, j in enumerate(layer_ids):
        slots.setdefault(j, []).append(k)
    aux = torch.empty((n_tok, len(layer_ids) * hidden), dtype=dtype, device=device)

    def keep(j: int, h: torch.Tensor) -> None:
        for k in slots.get(j, ()):
            aux[:, k * hidden : (k + 1) * hidden].copy_(h)

    h = m.embed_tokens(ids)
    keep(0, h)
    mla = fam.attention == "mla"
    rope = _Rope.at(m.rotary_emb, h, positions, interleaved=mla and bool(getattr(m.config, "rope_interleave", False)))
    attention = _mla_attention if mla else _gqa_attention
    x = _rms(m.layers[0].input_layernorm, h)
    for i, layer in enumerate(m.layers):
        # each residual add fused with the norm after it: the next layer's input norm, or the final one
        h, x = _residual(h, attention(layer.self_attn, x, rope, packing), layer.post_attention_layernorm)
        nxt = m.layers[i + 1].input_layernorm if i + 1 < num_layers else m.norm
        h, x = _residual(h, _mlp(layer.mlp, fam, x), nxt)
        if i + 1 < num_layers:
            keep(i + 1, h)
    last = x
    keep(num_layers, last)  # HF convention: the last hidden_states index is after the final norm
    return aux, last.to(dtype)
