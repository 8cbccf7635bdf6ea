"""A sparse MoE layer over a pack's rows: the model's own router, then each expert's rows as one
group of a grouped matrix multiply.

The router is the model's module, called as it is (Qwen3-MoE: softmax top-k, renormalized when
`norm_topk_prob`; DeepSeek-V3 / Kimi-K2: sigmoid scores plus the correction bias, grouped
top-k over `n_group` groups keeping `topk_group`, weights renormalized and times
`routed_scaling_factor`), so the choice and the weights are exactly the model's. The routed
rows are sorted by expert (stable), so each expert's rows are contiguous: on CUDA in bf16 one
grouped GEMM (torch's `grouped_mm`) per projection runs every expert, else one matmul per expert
that got rows (the reference, and what the CPU runs). Each token's k rows are summed with its
weights by one batched matmul (deterministic, float32 accumulation). On the grouped path the
elementwise steps between the GEMMs are compiled (`compiled.py`): SwiGLU in one kernel, and the
unsort plus weighted sum in one gather that reads each row once. Quantized experts
(`quantized.QuantExperts`) are dequantized `experts_per_chunk` experts at a time, just
before their GEMMs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .compiled import compiled


def _grouped_mm():
    """torch's grouped GEMM (`F.grouped_mm` in newer torch, `torch._grouped_mm` before), or None."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


class _Grouped:
    """Whether the grouped GEMM runs here; switched off for good, with the reason, the first time it fails."""

    ok = True
    why = ""


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    g, u = gate_up.chunk(2, dim=-1)
    return F.silu(g) * u


def _combine(out: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_k w[t, k] * out[inv[t*k + k']] for each token t, accumulated in float32 and rounded once:
    one pointwise kernel that reads each routed row once. (Written as a sum over a [n, k, H] view,
    inductor made a reduction kernel that ran at about a sixth of the card's bandwidth: 2.5 ms a
    layer for the Qwen3-MoE shape's 32,768-token pack on an H100, 17% of the forward.)"""
    n, k = weights.shape
    rows = inv.view(n, k)
    y = out[rows[:, 0]].float() * weights[:, :1].float()
    for j in range(1, k):
        y = y + out[rows[:, j]].float() * weights[:, j:j + 1].float()
    return y.to(out.dtype)


def moe_path(device: torch.device, dtype: torch.dtype) -> str:
    if device.type == "cuda" and dtype == torch.bfloat16 and _Grouped.ok and _grouped_mm() is not None:
        return "grouped_mm"
    return "per_expert_matmul" + (f" ({_Grouped.why})" if _Grouped.why else "")


def expert_weights(experts, e0: int, e1: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts e0..e1-1 as (gate_up [n, 2I, H], down [n, H, I]) in `dtype`: slices of
    transformers' fused parameters, or dequantized from quantized ones."""
    if hasattr(experts, "weights"):
        return experts.weights(e0, e1, dtype)
    return experts.gate_up_proj[e0:e1].to(dtype), experts.down_proj[e0:e1].to(dtype)


def routed_experts(experts, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """sum_k w[t, k] * expert_{idx[t, k]}(x[t]) for the rows x [N, H]: the routed part of the MoE.
    Experts that hold a share only (`expert_range`, expert parallel) run the rows routed to their
    share, zeros stand for the rest, and the ranks' sums are added by one all-reduce; every rank
    runs the same rows, so each reaches it once per layer."""
    n, k = top_k_index.shape
    num = experts.num_experts
    lo, hi = getattr(experts, "expert_range", (0, num))
    partial = (lo, hi) != (0, num)
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # each expert's rows contiguous, in token order
    xs = x[order // k]
    # rows per expert without a host sync (bincount on CUDA reads the max back first)
    counts = torch.zeros(num, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    chunk = getattr(experts, "experts_per_chunk", num) or num
    grouped = moe_path(x.device, x.dtype) == "grouped_mm"
    if grouped and chunk >= num and not partial:
        out = _grouped_chunk(experts, xs, counts, 0, num, x.dtype)
    else:
        out = (torch.zeros if partial else torch.empty)(xs.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
        ends = counts.cumsum(0).tolist()  # one host sync per layer (the loop needs the bounds)
        starts = [0] + ends[:-1]
        for e0 in range(lo, hi, chunk):
            e1 = min(e0 + chunk, hi)
            r0, r1 = starts[e0], ends[e1 - 1]
            if r0 == r1:
                continue
            if grouped:
                out[r0:r1] = _grouped_chunk(experts, xs[r0:r1], counts[e0:e1], e0, e1, x.dtype)
                continue
            gate_up, down = expert_weights(experts, e0, e1, x.dtype)
            for e in range(e0, e1):
                s, t = starts[e], ends[e]
                if s == t:
                    continue
                g, u = F.linear(xs[s:t], gate_up[e - e0]).chunk(2, dim=-1)
                out[s:t] = F.linear(F.silu(g) * u, down[e - e0])
    y = _weighted_sum(out, order, top_k_weights, x.dtype, grouped)
    if partial:
        torch.distributed.all_reduce(y)
    return y


def _weighted_sum(out: torch.Tensor, order: torch.Tensor, top_k_weights: torch.Tensor, dtype, grouped: bool):
    """The routed rows (in expert order) back in (token, k) order, each token's k rows summed with its weights."""
    n, k = top_k_weights.shape
    if grouped:
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)
        y = compiled(_combine, out, inv, top_k_weights)
        if y is not None:
            return y
    # Deterministic (no atomic adds) and accumulated in float32 inside the GEMM, rounded once, as
    # transformers' grouped_mm experts sum them; the weights are rounded to the rows' dtype (bf16:
    # 2^-9, the rows' own rounding) so that no float32 copy of the [N*k, H] rows is made.
    unsorted = torch.empty_like(out)
    unsorted[order] = out
    y = torch.bmm(top_k_weights.to(out.dtype).view(n, 1, k), unsorted.view(n, k, -1))
    return y.view(n, -1).to(dtype)


def _grouped_chunk(experts, xs, counts, e0: int, e1: int, dtype) -> torch.Tensor:
    mm = _grouped_mm()
    offs = counts.cumsum(0).to(torch.int32)
    gate_up, down = expert_weights(experts, e0, e1, dtype)
    try:
        gu = mm(xs, gate_up.transpose(-2, -1), offs=offs)
        h = compiled(_swiglu, gu)
        return mm(_swiglu(gu) if h is None else h, down.transpose(-2, -1), offs=offs)
    except (RuntimeError, TypeError, NotImplementedError) as e:  # an older build or another card
        _Grouped.ok, _Grouped.why = False, f"{type(e).__name__}: {e}"
        out = torch.empty(xs.shape[0], down.shape[1], dtype=dtype, device=xs.device)
        bounds = [0] + counts.cumsum(0).tolist()
        for e in range(e1 - e0):
            s, t = bounds[e], bounds[e + 1]
            if s < t:
                g, u = F.linear(xs[s:t], gate_up[e]).chunk(2, dim=-1)
                out[s:t] = F.linear(F.silu(g) * u, down[e])
        return out


def moe_block(mlp, x: torch.Tensor, dense) -> torch.Tensor:
    """A sparse MoE block (Qwen3-MoE's, DeepSeek-V3's) on rows x [N, H]: the model's router, the routed
    experts, plus the shared experts where the model has them (`dense(mlp, x)` runs a gated MLP)."""
    _, weights, index = mlp.gate(x)
    y = routed_experts(mlp.experts, x, index, weights)
    shared = getattr(mlp, "shared_experts", None)
    if shared is not None:
        y = y + dense(shared, x)
    return y
