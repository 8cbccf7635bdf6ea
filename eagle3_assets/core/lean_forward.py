"""The lean forward: a target's base model over samples packed end to end, by hand.

Token-wise ops (norms, projections, MLP) see the whole pack as one matrix; attention
runs per sample (causal, positions restart at 0), so each sample's rows equal an
unbatched run, with no padding anywhere. It reads the model's own weights, so it
needs the plain Hugging Face modules on one device (`lean_supported`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

def lean_supported(base_model) -> bool:
    """True for a plain Hugging Face `LlamaModel` on one device with no dispatch hooks."""
    try:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaModel, LlamaRMSNorm
    except ImportError:
        return False
    cfg = base_model.config
    if type(base_model) is not LlamaModel or getattr(cfg, "hidden_act", None) != "silu":
        return False
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return False
    if any(hasattr(m, "_hf_hook") for m in base_model.modules()):
        return False
    if len({p.device for p in base_model.parameters()}) != 1:
        return False
    norms = [base_model.norm] + [n for l in base_model.layers for n in (l.input_layernorm, l.post_attention_layernorm)]
    return all(type(l) is LlamaDecoderLayer for l in base_model.layers) and all(type(n) is LlamaRMSNorm for n in norms)


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
    """Causal attention of every sample of a pack with itself: q [N, Hq, D], k and v [N, Hkv, D]
    -> [N, Hq, D]. On CUDA in bf16/fp16 one FlashAttention varlen call does every sample (GQA
    included); elsewhere one SDPA call per sample, which for a pack of a few hundred short
    samples costs far more in launches than in arithmetic."""
    if len(packing.bounds) > 1 and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and _Varlen.ok:
        try:
            return torch.ops.aten._flash_attention_forward(
                q, k, v, packing.cu_seqlens, packing.cu_seqlens, packing.max_len, packing.max_len, 0.0, True, False,
                scale=scale,
            )[0]
        except (RuntimeError, TypeError, AttributeError, NotImplementedError) as e:  # an older or other build
            _Varlen.ok, _Varlen.why = False, f"{type(e).__name__}: {e}"
    gqa = q.shape[1] != k.shape[1]
    out = torch.empty_like(q)
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


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    # x * cos + rotate_half(x) * sin, with rotate_half(x) * sin == roll(x, D/2) * [-sin1, sin2]
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)


@torch.inference_mode()
def lean_forward(base_model, seqs: list[list[int]], layer_ids: list[int], dtype: torch.dtype):
    """The base model over samples packed end to end; returns (aux [N, k*H], last [N, H]) in
    `dtype`, rows in `seqs` order. Token-wise ops see the whole pack; attention runs per
    sample (causal, positions restart at 0), so each sample's rows equal an unbatched run."""
    m = base_model
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
    cos, sin = m.rotary_emb(h, positions[None])
    cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # [N, 1, D]
    half = sin.shape[-1] // 2
    sin_signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    for i, layer in enumerate(m.layers):
        a, mlp = layer.self_attn, layer.mlp
        x = _rms(layer.input_layernorm, h)
        d = a.head_dim
        q = F.linear(x, a.q_proj.weight, a.q_proj.bias).view(n_tok, -1, d)
        k_ = F.linear(x, a.k_proj.weight, a.k_proj.bias).view(n_tok, -1, d)
        v = F.linear(x, a.v_proj.weight, a.v_proj.bias).view(n_tok, -1, d)
        q, k_ = _rope(q, cos, sin_signed), _rope(k_, cos, sin_signed)
        o = packed_causal_attention(q, k_, v, packing, a.scaling).view(n_tok, -1)
        h = h + F.linear(o, a.o_proj.weight, a.o_proj.bias)
        x = _rms(layer.post_attention_layernorm, h)
        g = F.silu(F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias))
        g = g.mul_(F.linear(x, mlp.up_proj.weight, mlp.up_proj.bias))
        h = h + F.linear(g, mlp.down_proj.weight, mlp.down_proj.bias)
        del x, q, k_, v, o, g
        if i + 1 < num_layers:
            keep(i + 1, h)
    last = _rms(m.norm, h)
    keep(num_layers, last)  # HF convention: the last hidden_states index is after the final norm
    return aux, last.to(dtype)


