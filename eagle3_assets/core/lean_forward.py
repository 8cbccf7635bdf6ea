"""The lean forward: a target's base model over samples packed end to end, by hand.

Token-wise ops (norms, projections, MLP) see the whole pack as one matrix; attention
runs per sample (causal, positions restart at 0), so each sample's rows equal an
unbatched run, with no padding anywhere. It reads the model's own weights, so it
needs the plain Hugging Face modules on one device (`lean_supported`).
"""

from __future__ import annotations

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
        gqa = q.shape[1] != k_.shape[1]
        if len(bounds) == 1:
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k_.transpose(0, 1)[None], v.transpose(0, 1)[None],
                is_causal=True, scale=a.scaling, enable_gqa=gqa,
            )[0].transpose(0, 1).reshape(n_tok, -1)
        else:
            o = torch.empty_like(q)
            for s, e in bounds:
                o[s:e] = F.scaled_dot_product_attention(
                    q[s:e].transpose(0, 1)[None], k_[s:e].transpose(0, 1)[None], v[s:e].transpose(0, 1)[None],
                    is_causal=True, scale=a.scaling, enable_gqa=gqa,
                )[0].transpose(0, 1)
            o = o.view(n_tok, -1)
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


