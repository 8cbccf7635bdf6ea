"""The EAGLE-3 drafter: one Llama decoder layer that reads the target's hidden states.

Read top to bottom: config, RMSNorm, rotary embedding, attention, MLP, the decoder layer
("midlayer"), the drafter with its training-time-test forward and its decoding API, and the
checkpoint writer/reader. Module names are the official checkpoint keys
(`fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`), so `state_dict()`
is the checkpoint.

Semantics follow the official SafeAILab/EAGLE `eagle/traineagle3/cnets.py` (checked; SpecForge's
`specforge/core/eagle3.py` copies it):

- `fc` maps the three concatenated aux hidden states (3 * target_hidden_size) to hidden_size.
- At every step the layer input is `cat(input_layernorm(embed(token)), hidden_norm(hidden))`
  (embeddings first); the residual is `hidden`; the layer output (before `norm`) is the next
  step's `hidden`; logits are `lm_head(norm(output))` over the draft vocabulary.
- Position t of the sequence pairs the target's hidden state at t (which has seen tokens <= t)
  with the embedding of token t+1, and predicts token t+2.
"""

from __future__ import annotations

import json
import math
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .files import atomic_path, atomic_write_text

CHECKPOINT_ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # the target's vocabulary (embeddings, t2d)
    draft_vocab_size: int  # the drafter head's vocabulary (lm_head, d2t)
    target_hidden_size: int
    # Hugging Face `hidden_states` index: 0 = embeddings, j = output of decoder layer j-1.
    aux_layer_ids: list[int] = field(default_factory=list)
    hidden_act: str = "silu"

    @classmethod
    def from_target_config(cls, target_config, draft_vocab_size: int, aux_layer_ids: list[int]) -> "DrafterConfig":
        """The drafter's shape from the target's transformers config: the target's hidden size,
        vocabulary, RMSNorm epsilon, RoPE base and context length, and its attention shape.

        The drafter is always one Llama layer. A Llama/Qwen target (dense or MoE) gives its own
        heads, key-value heads and head size. A target with multi-head latent attention
        (DeepSeek-V3, Kimi-K2: `kv_lora_rank` in the config) has no plain head shape to copy, so
        the drafter takes 128-wide heads over the hidden size (DeepSeek-V3's 7,168: 56 heads) and
        gcd(heads, 8) key-value heads (8), as the published DeepSeek-V3 EAGLE-3 drafter does.
        The MLP width is the target's dense `intermediate_size` (an MoE target's dense-layer size,
        e.g. 18,432 for DeepSeek-V3, 6,144 for Qwen3-30B-A3B). The drafter's RoPE is the plain one
        at the target's `rope_theta`: a long-context scaling (YaRN, Llama-3) is not copied, as the
        drafter is trained and served at the lengths of its training data."""
        rope_parameters = getattr(target_config, "rope_parameters", None) or {}
        rope_theta = rope_parameters.get("rope_theta", getattr(target_config, "rope_theta", None))
        if rope_theta is None:
            raise ValueError("target config has neither rope_parameters['rope_theta'] nor rope_theta")
        hidden = target_config.hidden_size
        if getattr(target_config, "kv_lora_rank", None) is not None:  # multi-head latent attention
            head_dim = 128 if hidden % 128 == 0 else hidden // target_config.num_attention_heads
            heads = hidden // head_dim
            kv_heads = math.gcd(heads, 8)
        else:
            heads = target_config.num_attention_heads
            head_dim = getattr(target_config, "head_dim", None) or hidden // heads
            kv_heads = getattr(target_config, "num_key_value_heads", None) or heads
        num_layers = target_config.num_hidden_layers
        bad = [i for i in aux_layer_ids if not 0 <= i <= num_layers]
        if len(aux_layer_ids) != 3 or bad:
            raise ValueError(
                f"aux_layer_ids must be 3 Hugging Face hidden_states indices in [0, {num_layers}] "
                f"(default [2, {num_layers // 2}, {num_layers - 3}]); got {aux_layer_ids}"
            )
        return cls(
            hidden_size=hidden,
            intermediate_size=target_config.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=target_config.rms_norm_eps,
            rope_theta=float(rope_theta),
            max_position_embeddings=target_config.max_position_embeddings,
            vocab_size=target_config.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=hidden,
            aux_layer_ids=list(aux_layer_ids),
            hidden_act=getattr(target_config, "hidden_act", "silu"),
        )


# ---------------------------------------------------------------------------------------------
# Building blocks (Llama)
# ---------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


def silu_gate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def diag_merge(q, out_p, lse_p, dks, dvs, scale: float):
    """The TTT attention's forward merge (`TTTAttention`): the prefix's out_p [N, H, D] and
    lse_p [N, H] with the diagonal keys/values dks/dvs [N, Hk, D] through log-sum-exp, one
    diagonal at a time (`_ops["diag_merge_step"]`: every step has the same shapes, so compiled it
    is one kernel and one compilation for any count). Returns (out [N, H, D] in q's dtype, lse
    [N, H], diagonal scores [steps, N, H]), float32 math."""
    out, lse, scores = out_p.float(), lse_p.float().contiguous(), []
    for dk, dv in zip(dks, dvs):
        out, lse, s = _ops["diag_merge_step"](q, out, lse, dk, dv, scale)
        scores.append(s)
    return out.to(q.dtype), lse, torch.stack(scores)


def diag_merge_step(q, out, lse, dk, dv, scale: float):
    """One diagonal key/value merged into (out [N, H, D] float32, lse [N, H]): the new pair and the
    diagonal's score. Query heads are grouped by their key-value head, [N, Hk, n_rep, D]: a
    diagonal key [N, Hk, D] broadcasts over its group, so no repeated copy of it is made."""
    N, H, D = q.shape
    Hk = dk.shape[1]
    s = (q.float().reshape(N, Hk, -1, D) * dk.float()[:, :, None]).sum(-1).view(N, H) * scale
    new_lse = torch.logaddexp(lse, s)
    out = (torch.exp(lse - new_lse)[..., None] * out).view(N, Hk, -1, D) \
        + torch.exp(s - new_lse).view(N, Hk, -1, 1) * dv.float()[:, :, None]
    return out.view(N, H, D), new_lse, s


def diag_merge_backward(q, dout, out, lse, dq, scores, dks, dvs, scale: float, step=None):
    """The diagonal terms of `TTTAttention`'s backward: dq (the prefix's, [N, H, D]) plus
    theirs, and each diagonal key's and value's gradient, one diagonal at a time (`step`:
    `diag_merge_backward_step`, compiled when the forward ran so)."""
    N, H, D = q.shape
    Hk = dks[0].shape[1]
    row = (dout.float() * out.float()).view(N, Hk, -1, D).sum(-1)  # [N, Hk, n_rep]
    dq, d_dks, d_dvs, step = dq.float().contiguous(), [], [], step or diag_merge_backward_step
    for i, (dk_i, dv_i) in enumerate(zip(dks, dvs)):
        dq, d_dk, d_dv = step(q, dout, row, lse, dq, scores[i], dk_i, dv_i, scale)
        d_dks.append(d_dk)
        d_dvs.append(d_dv)
    return dq.to(q.dtype), d_dks, d_dvs


def diag_merge_backward_step(q, dout, row, lse, dq, s, dk, dv, scale: float):
    """One diagonal's share of the backward: p = e^(s - lse), ds = p (dout.dv - row) scale; dq
    (float32) gains ds dk; returns it with the diagonal key's and value's gradients."""
    N, H, D = q.shape
    Hk = dk.shape[1]
    qg, dout_g = q.float().reshape(N, Hk, -1, D), dout.float().reshape(N, Hk, -1, D)
    p = torch.exp(s - lse).view(N, Hk, -1)
    ds = p * ((dout_g * dv.float()[:, :, None]).sum(-1) - row) * scale
    dq = (dq.view(N, Hk, -1, D) + ds[..., None] * dk.float()[:, :, None]).view(N, H, D)
    return dq, (ds[..., None] * qg).sum(2).to(dk.dtype), (p[..., None] * dout_g).sum(2).to(dv.dtype)


# The layer's elementwise math goes through this table. `fused_pointwise()` (training.compile on
# CUDA) swaps in torch.compile'd versions: each becomes a kernel or two instead of 5-40 launches
# over [N, H] float32 tensors (such launches were a third of the CUDA-graphed step's GPU time).
_POINTWISE = {f.__name__: f for f in (rms_norm, apply_rope, silu_gate, diag_merge_step, diag_merge_backward_step)}
_ops = dict(_POINTWISE)
_compiled: dict[str, dict] = {}


@contextmanager
def fused_pointwise(enabled: bool = True, backend: str = "inductor"):
    """Within the block, the drafter's elementwise math runs compiled (`backend`; dynamic
    shapes, so packed rows of any length share one compilation per diagonal count)."""
    saved = dict(_ops)
    if enabled:
        if backend not in _compiled:
            _compiled[backend] = {name: torch.compile(f, dynamic=True, fullgraph=True, backend=backend)
                                  for name, f in _POINTWISE.items()}
        _ops.update(_compiled[backend])
    try:
        yield
    finally:
        _ops.update(saved)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ops["rms_norm"](x, self.weight, self.eps)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, kv_heads, T, D] -> [B, kv_heads * n_rep, T, D] (grouped-query attention)."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


class DrafterCache:
    """Keys and values of the drafter's single attention layer.

    `keys`/`values` [B, kv_heads, L, D] hold the causal prefix: entry s is visible to every query
    at index >= s. `diag_keys`/`diag_values` exist only during training-time test: one [B,
    kv_heads, T, D] tensor per step >= 1, whose entry t is visible to the query at index t only.
    Keys are stored after RoPE, so cropping is just slicing.
    """

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.diag_keys: list[torch.Tensor] = []
        self.diag_values: list[torch.Tensor] = []

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def crop(self, length: int) -> None:
        """Keep the first `length` prefix entries (drop drafted or rejected positions)."""
        if self.keys is not None:
            self.keys = self.keys[:, :, :length]
            self.values = self.values[:, :, :length]


class Eagle3Attention(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        # q/k/v read cat(embeddings, hidden): 2 * hidden_size wide.
        self.q_proj = nn.Linear(2 * config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: DrafterCache,
        diagonal: bool,
    ) -> torch.Tensor:
        """`diagonal=False`: append the new keys to the causal prefix (step 0, decoding).
        `diagonal=True`: TTT step >= 1, the new keys are seen only by their own position."""
        if isinstance(cache, PackedTTTCache):
            return self._packed_forward(x, cos, sin, cache, diagonal)
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin

        if diagonal:
            query_index = torch.arange(T, device=x.device)  # queries are the prefix positions
            cache.diag_keys.append(k)
            cache.diag_values.append(v)
        else:
            query_index = cache.length + torch.arange(T, device=x.device)
            cache.keys = k if cache.keys is None else torch.cat((cache.keys, k), dim=2)
            cache.values = v if cache.values is None else torch.cat((cache.values, v), dim=2)

        n_rep = self.num_heads // self.num_kv_heads
        scale = 1.0 / math.sqrt(self.head_dim)
        keys, values = repeat_kv(cache.keys, n_rep), repeat_kv(cache.values, n_rep)
        scores = (q @ keys.transpose(2, 3)) * scale  # [B, H, T, L]
        key_index = torch.arange(keys.shape[2], device=x.device)
        future = key_index[None, :] > query_index[:, None]
        scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)
        # The "cache_hidden" trick of the official code: each TTT step adds one key per
        # position, visible to that position only, so a score per position is enough.
        diag_scores = [(q * repeat_kv(dk, n_rep)).sum(-1, keepdim=True) * scale for dk in cache.diag_keys]
        probs = torch.softmax(torch.cat([scores, *diag_scores], dim=-1).float(), dim=-1).to(q.dtype)

        L = keys.shape[2]
        out = probs[..., :L] @ values
        for i, dv in enumerate(cache.diag_values):
            out = out + probs[..., L + i : L + i + 1] * repeat_kv(dv, n_rep)
        out = out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)
        return self.o_proj(out)

    def _packed_forward(self, x, cos, sin, cache: "PackedTTTCache", diagonal: bool) -> torch.Tensor:
        """TTT on one packed row x [1, N, 2H] (cos/sin [N, D]): step 0 fills the prefix keys,
        a step >= 1 adds its diagonal keys; `TTTAttention` attends without a score matrix."""
        N = x.shape[1]
        q = self.q_proj(x).view(N, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(N, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(N, self.num_kv_heads, self.head_dim)
        cos, sin = cos[:, None, :], sin[:, None, :]
        q, k = _ops["apply_rope"](q, cos, sin), _ops["apply_rope"](k, cos, sin)
        if diagonal:
            cache.diag_keys.append(k)
            cache.diag_values.append(v)
        else:
            if cache.keys is not None:
                raise RuntimeError("a packed TTT forward has one prefix step (step 0)")
            cache.keys, cache.values = k, v
        if cache.impl == "flash":  # the kernel takes bf16/fp16; autocast leaves q in the compute dtype
            q, k0, v0 = q.contiguous(), cache.keys.contiguous(), cache.values.contiguous()
        else:
            k0, v0 = cache.keys, cache.values
        out = TTTAttention.apply(q, k0, v0, cache.geometry, 1.0 / math.sqrt(self.head_dim), *cache.diag_keys,
                                 *cache.diag_values)
        return self.o_proj(out.reshape(1, N, self.num_heads * self.head_dim))


# ---------------------------------------------------------------------------------------------
# Training on packed rows: TTT attention without the score matrix
# ---------------------------------------------------------------------------------------------


class PackedGeometry:
    """Where the samples of a packed row lie: `cu_seqlens` [S+1] (int32, on the row's device),
    the longest sample, and `impl`, the prefix attention: "flash" (FlashAttention varlen, CUDA
    bf16/fp16) or "math" (per sample in float32: the reference path). It holds no tensor of the
    autograd graph, so the attention nodes can keep it without a reference cycle."""

    def __init__(self, cu_seqlens: torch.Tensor, max_len: int, impl: str):
        if impl not in ("flash", "math"):
            raise ValueError(f"packed TTT attention impl must be 'flash' or 'math', got {impl!r}")
        self.cu_seqlens, self.max_len, self.impl = cu_seqlens.detach().to(torch.int32), int(max_len), impl
        self._bounds: list[tuple[int, int]] | None = None
        self.flash_rng: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def bounds(self) -> list[tuple[int, int]]:
        """(start, end) of each sample; read back once, only where needed (the math path)."""
        if self._bounds is None:
            cu = self.cu_seqlens.tolist()
            self._bounds = list(zip(cu[:-1], cu[1:]))
        return self._bounds


class PackedTTTCache:
    """The keys of a TTT forward over one packed row of samples ([N] tokens, `geometry` the
    sample bounds): step 0's keys/values [N, kv_heads, D] (the causal prefix, within each
    sample) and one [N, kv_heads, D] pair per step >= 1 (index t's own key, seen by t only)."""

    def __init__(self, cu_seqlens: torch.Tensor, max_len: int, impl: str):
        self.geometry = PackedGeometry(cu_seqlens, max_len, impl)
        self.impl = impl
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.diag_keys: list[torch.Tensor] = []
        self.diag_values: list[torch.Tensor] = []


def _expand_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[N, kv_heads, D] -> [N, heads, D] (head h reads kv head h // n_rep, as repeat_kv)."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def _reduce_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """The gradient of `_expand_kv`: [N, heads, D] -> [N, kv_heads, D]."""
    return x if n_rep == 1 else x.unflatten(1, (-1, n_rep)).sum(2)


def _math_prefix_forward(q, k, v, geo: PackedGeometry, scale: float):
    """Causal attention within each sample, in float32: out [N, H, D] (q's dtype), lse [H, N]."""
    n_rep = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    with torch.autocast(q.device.type, enabled=False):  # float32 also under a bf16 autocast
        for s, e in geo.bounds:
            if e == s:  # a zero-length segment (a static row's slack entries)
                continue
            _math_prefix_sample(q, k, v, s, e, n_rep, scale, out, lse)
    return out, lse


def _math_prefix_sample(q, k, v, s: int, e: int, n_rep: int, scale: float, out, lse) -> None:
    """One sample's causal attention, written into out[s:e] and lse[:, s:e]."""
    qs = q[s:e].float().transpose(0, 1)  # [H, n, D]
    ks, vs = (_expand_kv(x[s:e], n_rep).float().transpose(0, 1) for x in (k, v))
    scores = (qs @ ks.transpose(1, 2)) * scale
    future = torch.ones(e - s, e - s, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    lse[:, s:e] = torch.logsumexp(scores, dim=-1)
    out[s:e] = (torch.softmax(scores, dim=-1) @ vs).transpose(0, 1).to(q.dtype)


def _math_prefix_backward(dout, q, k, v, out, lse, geo: PackedGeometry, scale: float):
    """The FlashAttention backward in float32, per sample: probabilities exp(s - lse) and the
    row term sum(dout * out) come from the given out/lse (which may be the merged ones)."""
    n_rep = q.shape[1] // k.shape[1]
    dq, dk, dv = (torch.zeros_like(x, dtype=torch.float32) for x in (q, k, v))
    for s, e in geo.bounds:
        if e == s:
            continue
        qs = q[s:e].float().transpose(0, 1)
        ks, vs = (_expand_kv(x[s:e], n_rep).float().transpose(0, 1) for x in (k, v))
        do, o = dout[s:e].float().transpose(0, 1), out[s:e].float().transpose(0, 1)
        future = torch.ones(e - s, e - s, dtype=torch.bool, device=q.device).triu(1)
        probs = torch.exp(((qs @ ks.transpose(1, 2)) * scale - lse[:, s:e, None]).masked_fill(future, float("-inf")))
        dprobs = do @ vs.transpose(1, 2)
        dscores = probs * (dprobs - (do * o).sum(-1, keepdim=True))
        dq[s:e] = (dscores @ ks).transpose(0, 1) * scale
        dk[s:e] = _reduce_kv((dscores.transpose(1, 2) @ qs).transpose(0, 1) * scale, n_rep)
        dv[s:e] = _reduce_kv((probs.transpose(1, 2) @ do).transpose(0, 1), n_rep)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _flash_lse_unpadded(lse: torch.Tensor, geo: PackedGeometry) -> torch.Tensor:
    """FlashAttention varlen's log-sum-exp as [H, N]: recent builds return it so; older ones as
    [B, H, max_len] (padded per sample), converted here."""
    if lse.dim() == 2:
        return lse
    sample, local = _flash_index(geo, lse.device)
    return lse[sample, :, local].transpose(0, 1)


def _flash_lse_like(merged: torch.Tensor, raw: torch.Tensor, geo: PackedGeometry) -> torch.Tensor:
    """The merged [H, N] log-sum-exp in the layout the kernel returned (`raw`)."""
    if raw.dim() == 2:
        return merged.contiguous()
    sample, local = _flash_index(geo, merged.device)
    padded = torch.zeros_like(raw)
    padded[sample, :, local] = merged.transpose(0, 1)
    return padded


def _flash_index(geo: PackedGeometry, device) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = [e - s for s, e in geo.bounds]
    sample = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    starts = torch.tensor([s for s, _ in geo.bounds], device=device)
    local = torch.arange(int(sum(lengths)), device=device) - starts[sample]
    return sample, local


class _Flash:
    """Whether the FlashAttention ops work in this build; after a first failure (an older or
    other build) the math path does the prefix instead, with one warning."""

    ok = True

    @classmethod
    def fail(cls, where: str, e: Exception) -> None:
        if cls.ok:
            warnings.warn(f"FlashAttention varlen {where} failed ({type(e).__name__}: {e}); the packed TTT attention "
                          "falls back to the per-sample math path (slow: set training.attention to 'padded' or fix "
                          "the build)", RuntimeWarning, stacklevel=3)
        cls.ok = False


_FLASH_ERRORS = (RuntimeError, TypeError, AttributeError, NotImplementedError)


def _flash_prefix_forward(q, k, v, geo: PackedGeometry, scale: float):
    if _Flash.ok:
        try:
            out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
                q, k, v, geo.cu_seqlens, geo.cu_seqlens, geo.max_len, geo.max_len, 0.0, True, False, scale=scale)
            geo.flash_rng = (seed, offset)
            return out, lse
        except _FLASH_ERRORS as e:
            _Flash.fail("forward", e)
    geo.impl = "math"  # this row's backward goes the same way
    return _math_prefix_forward(q, k, v, geo, scale)


def _flash_prefix_backward(dout, q, k, v, out, lse, geo: PackedGeometry, scale: float):
    if _Flash.ok:
        try:
            seed, offset = geo.flash_rng  # unused at dropout 0, but part of the op's signature
            return torch.ops.aten._flash_attention_backward(
                dout.contiguous(), q, k, v, out.contiguous(), lse, geo.cu_seqlens, geo.cu_seqlens, geo.max_len,
                geo.max_len, 0.0, True, seed, offset, scale=scale)
        except _FLASH_ERRORS as e:
            _Flash.fail("backward", e)
    return _math_prefix_backward(dout, q, k, v, out, _flash_lse_unpadded(lse, geo), geo, scale)


class TTTAttention(torch.autograd.Function):
    """Attention of TTT step k on a packed row: query t sees step 0's keys s..t of its own sample
    (s its sample's start) and its own keys of steps 1..k, without a score matrix.

    Forward: the prefix attention (FlashAttention varlen, or the float32 math path) gives out_p
    and its log-sum-exp lse_p; the k diagonal scores s_i = q_t . dk_i,t are merged through
    log-sum-exp: lse = logsumexp(lse_p, s_1..s_k), out = e^(lse_p - lse) out_p + sum_i
    e^(s_i - lse) dv_i. Backward: the prefix attention's own backward, called with the MERGED
    out and lse (the ring-attention identity: its probabilities exp(score - lse) are then the
    merged ones, and its row term sum(dout * out) is the merged softmax's, so its dq/dk/dv are
    exact), plus the diagonal terms by hand: p_i = e^(s_i - lse), ds_i = p_i (dout.dv_i -
    sum(dout * out)), dq += ds_i dk_i scale, d dk_i = ds_i q scale, d dv_i = p_i dout."""

    @staticmethod
    def forward(ctx, q, k, v, geo: PackedGeometry, scale: float, *diag):
        flash = geo.impl == "flash"
        out_p, raw_lse = (_flash_prefix_forward if flash else _math_prefix_forward)(q, k, v, geo, scale)
        flash = geo.impl == "flash"  # still: the op ran (else it fell back to the math path)
        lse_p = (_flash_lse_unpadded(raw_lse, geo) if flash else raw_lse).transpose(0, 1)  # [N, H]
        steps = len(diag) // 2
        dks, dvs = diag[:steps], diag[steps:]
        if steps:
            out, lse, diag_scores = diag_merge(q, out_p, lse_p, dks, dvs, scale)
        else:
            out, lse, diag_scores = out_p, lse_p, lse_p.new_empty(0)
        merged_lse = lse.transpose(0, 1).contiguous()
        if flash:
            merged_lse = _flash_lse_like(merged_lse, raw_lse, geo)
        ctx.save_for_backward(q, k, v, out, merged_lse, lse, diag_scores, *diag)
        ctx.geo, ctx.scale, ctx.steps, ctx.flash = geo, scale, steps, flash
        ctx.backward_step = _ops["diag_merge_backward_step"]  # compiled or not, as the forward ran
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, merged_lse, lse, diag_scores, *diag = ctx.saved_tensors
        steps, scale, geo = ctx.steps, ctx.scale, ctx.geo
        dout = dout.to(q.dtype)
        prefix_backward = _flash_prefix_backward if ctx.flash else _math_prefix_backward
        dq, dk, dv = prefix_backward(dout, q, k, v, out, merged_lse, geo, scale)
        if not steps:
            return dq, dk, dv, None, None
        dq, d_dks, d_dvs = diag_merge_backward(q, dout, out, lse, dq, diag_scores, diag[:steps], diag[steps:], scale,
                                               ctx.backward_step)
        return dq, dk, dv, None, None, *d_dks, *d_dvs


class Eagle3MLP(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = getattr(F, config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_fn is F.silu:
            return self.down_proj(_ops["silu_gate"](self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    """The "midlayer": a Llama decoder layer whose attention reads cat(embeddings, hidden)."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.self_attn = Eagle3Attention(config)
        self.mlp = Eagle3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_embeds, hidden_states, cos, sin, cache: DrafterCache, diagonal: bool):
        residual = hidden_states  # the residual stream is the fc output (or the previous step's)
        x = torch.cat((self.input_layernorm(input_embeds), self.hidden_norm(hidden_states)), dim=-1)
        hidden_states = residual + self.self_attn(x, cos, sin, cache, diagonal)
        residual = hidden_states
        hidden_states = residual + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states


# ---------------------------------------------------------------------------------------------
# The drafter
# ---------------------------------------------------------------------------------------------


def shift_left(x: torch.Tensor, by: int = 1) -> torch.Tensor:
    """x[:, t] <- x[:, t + by], zero-filled at the end (the official `padding(x, left=False)`)."""
    if by == 0:
        return x
    return torch.cat((x[:, by:], torch.zeros_like(x[:, :by])), dim=1)


class Eagle3Drafter(nn.Module):
    def __init__(self, config: DrafterConfig, embed_tokens_weight: torch.Tensor):
        super().__init__()
        self.config = config
        if tuple(embed_tokens_weight.shape) != (config.vocab_size, config.hidden_size):
            raise ValueError(
                f"embed_tokens_weight has shape {tuple(embed_tokens_weight.shape)}, expected "
                f"[vocab_size={config.vocab_size}, hidden_size={config.hidden_size}] (the target's embeddings)"
            )
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        # Vocab maps (set from the vocab_map asset); part of the checkpoint.
        d2t = torch.zeros(config.draft_vocab_size, dtype=torch.int64)
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)
        # The target's embeddings: frozen and not part of the checkpoint (engines use the
        # target's own), hence a non-persistent buffer.
        self.register_buffer("embed_tokens", embed_tokens_weight.detach().clone(), persistent=False)

    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(
                f"vocab map shapes d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)} do not match the drafter's "
                f"draft_vocab_size={self.config.draft_vocab_size}, vocab_size={self.config.vocab_size}"
            )
        self.d2t.copy_(d2t.to(torch.int64))
        self.t2d.copy_(t2d.to(torch.bool))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_tokens).to(self.fc.weight.dtype)

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of shape [T, head_dim] for 1-D positions (Llama's default RoPE), computed in
        float32 whatever the weights' dtype."""
        dim = self.config.head_dim
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, dim, 2, device=positions.device).float() / dim))
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden_states))

    # -- training: training-time test (TTT) ---------------------------------------------------

    def ttt_forward(self, input_ids: torch.Tensor, aux_hidden_states: torch.Tensor, steps: int = 7) -> list[torch.Tensor]:
        """Unrolled draft logits for `steps` steps, as in the official `traineagle3` `Model.forward`.

        input_ids [B, T] are the stored token ids (unshifted); aux_hidden_states [B, T, 3*H_t].
        Returns a list of `steps` tensors [B, T, draft_vocab_size]. In step k, index t reads the
        embedding of token t+k+1 and the hidden state of step k-1 at index t (step 0: fc(aux_t)),
        sits at RoPE position t+k (the official `position_ids + lck`), and predicts token t+k+2,
        i.e. the target's distribution at position t+k+1. Attention in step k: step 0's keys
        at indices <= t, plus index t's own keys from steps 1..k. Right padding never reaches
        a valid index (everything is causal), so no padding mask is needed; the loss masks it.
        (Some SpecForge versions also hide step 0's keys t-k+1..t from step k; we follow the
        official code, in which step k still sees all of step 0's keys <= t.)
        """
        T = input_ids.shape[1]
        hidden_states = self.fc(aux_hidden_states)
        ids = shift_left(input_ids, 1)  # index t reads token t+1
        positions = torch.arange(T, device=input_ids.device)
        cache = DrafterCache()
        logits = []
        for k in range(steps):
            cos, sin = self.rotary(positions + k, hidden_states.dtype)
            hidden_states = self.midlayer(self.embed(ids), hidden_states, cos, sin, cache, diagonal=k > 0)
            logits.append(self.compute_logits(hidden_states))
            ids = shift_left(ids, 1)
        return logits

    def forward(self, input_ids: torch.Tensor, aux_hidden_states: torch.Tensor, steps: int = 7, **packed) -> list[torch.Tensor]:
        """`ttt_forward`, or with `packed` (cu_seqlens, positions, max_len, attention) the packed
        `ttt_forward_packed` (one entry point, so that DDP wraps either)."""
        if packed:
            return self.ttt_forward_packed(input_ids, aux_hidden_states, steps=steps, **packed)
        return self.ttt_forward(input_ids, aux_hidden_states, steps)

    def ttt_forward_packed(
        self,
        input_ids: torch.Tensor,
        aux_hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor,
        positions: torch.Tensor,
        max_len: int,
        attention: str = "math",
        steps: int = 7,
    ) -> list[torch.Tensor]:
        """`ttt_forward` on one packed row of samples, returning each step's layer output
        (pre-norm) [N, H] instead of logits (the loss applies norm + lm_head in chunks).

        input_ids [N] and aux_hidden_states [N, 3*H_t] are the samples concatenated; cu_seqlens
        [S+1] their bounds; positions [N] each token's index within its sample (RoPE restarts
        per sample). Shifts run over the whole row, so near a sample's end index t reads the
        next sample's tokens; such t never enter the loss (see `packed_ttt_loss`), and no
        counted t depends on them: a counted t (token t+k+2 inside its sample) reads tokens
        t+1..t+k+1 on its own diagonal and step-0 keys j <= t of its sample (token j+1 <= t+1),
        all inside the sample, and attention never crosses a sample bound. So every counted
        position computes exactly what the padded `ttt_forward` computes for it."""
        hidden_states = self.fc(aux_hidden_states)[None]  # [1, N, H]: the layer's batch of one row
        ids = torch.cat((input_ids[1:], input_ids.new_zeros(1)))[None]
        cache = PackedTTTCache(cu_seqlens, max_len, attention)
        outputs = []
        for k in range(steps):
            cos, sin = self.rotary(positions + k, hidden_states.dtype)
            hidden_states = self.midlayer(self.embed(ids), hidden_states, cos, sin, cache, diagonal=k > 0)
            outputs.append(hidden_states[0])
            ids = shift_left(ids, 1)
        return outputs

    # -- decoding: KV-cached drafting for speculative decoding -------------------------------

    def decode(self, input_ids: torch.Tensor, hidden_states: torch.Tensor, cache: DrafterCache) -> torch.Tensor:
        """Run the layer on new positions appended to `cache` (causal). Returns the layer output
        (pre-norm) [B, m, H]. `hidden_states` is fc(aux) for target positions, or the previous
        output for drafted ones."""
        m = input_ids.shape[1]
        positions = cache.length + torch.arange(m, device=input_ids.device)
        cos, sin = self.rotary(positions, hidden_states.dtype)
        return self.midlayer(self.embed(input_ids), hidden_states, cos, sin, cache, diagonal=False)

    @torch.no_grad()
    def propose(
        self,
        aux_hidden_states: torch.Tensor,
        next_ids: torch.Tensor,
        cache: DrafterCache,
        num_draft_tokens: int,
    ) -> torch.Tensor:
        """Greedy chain of `num_draft_tokens` draft tokens, as target ids [B, K].

        aux_hidden_states [B, m, 3*H_t]: the target's aux states for the m context positions
        not yet in `cache`; next_ids [B, m]: the token after each of them (for the last one,
        the target's newest token). Those m positions are added to `cache`; the drafted
        positions are cropped off again before returning, because after verification they are
        re-run with the target's own hidden states (as in official EAGLE decoding).
        """
        context_length = cache.length + next_ids.shape[1]
        hidden = self.decode(next_ids, self.fc(aux_hidden_states.to(self.fc.weight.dtype)), cache)[:, -1:]
        drafts = []
        for i in range(num_draft_tokens):
            draft_ids = self.compute_logits(hidden).argmax(-1)  # [B, 1], draft vocabulary
            token = draft_ids + self.d2t[draft_ids]  # -> target vocabulary
            drafts.append(token)
            if i + 1 < num_draft_tokens:
                hidden = self.decode(token, hidden, cache)
        cache.crop(context_length)
        return torch.cat(drafts, dim=1)


# ---------------------------------------------------------------------------------------------
# Checkpoint (official EAGLE-3 layout, loaded by SGLang and vLLM)
# ---------------------------------------------------------------------------------------------


def expected_shapes(config: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every key of the official checkpoint and its shape."""
    H, I = config.hidden_size, config.intermediate_size
    q_out = config.num_attention_heads * config.head_dim
    kv_out = config.num_key_value_heads * config.head_dim
    return {
        "fc.weight": (H, 3 * config.target_hidden_size),
        "midlayer.self_attn.q_proj.weight": (q_out, 2 * H),
        "midlayer.self_attn.k_proj.weight": (kv_out, 2 * H),
        "midlayer.self_attn.v_proj.weight": (kv_out, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, q_out),
        "midlayer.mlp.gate_proj.weight": (I, H),
        "midlayer.mlp.up_proj.weight": (I, H),
        "midlayer.mlp.down_proj.weight": (H, I),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        "norm.weight": (H,),
        "lm_head.weight": (config.draft_vocab_size, H),
        "d2t": (config.draft_vocab_size,),
        "t2d": (config.vocab_size,),
    }


def checkpoint_config(config: DrafterConfig, dtype: torch.dtype) -> dict:
    """config.json in the official EAGLE-3 layout.

    `eagle_config.eagle_aux_hidden_state_layer_ids` uses the Hugging Face `hidden_states`
    convention (0 = embeddings, j = output of layer j-1), which is what vLLM reads as given.
    SGLang and ModelOpt count "output of layer X" (each id minus one) and some SGLang versions
    shift by +1 (sglang PR 25454): check the engine before serving.
    """
    return {
        "architectures": [CHECKPOINT_ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,  # the drafter is trained with plain RoPE at rope_theta
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
            "use_aux_hidden_state": True,
        },
    }


def save_checkpoint(
    model: Eagle3Drafter,
    out_dir: str | Path,
    extra_config: dict | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write `config.json` and `model.safetensors` (weights in `dtype`, default the model's;
    `d2t` int64, `t2d` bool). Each file goes to a temporary name first and is renamed into place."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = dtype or model.fc.weight.dtype
    state = model.state_dict()
    shapes = expected_shapes(model.config)
    if set(state) != set(shapes):
        raise RuntimeError(f"drafter state_dict keys differ from the checkpoint contract: {sorted(set(state) ^ set(shapes))}")
    tensors = {}
    for key, tensor in state.items():
        if key == "d2t":
            tensors[key] = tensor.to(torch.int64)
        elif key == "t2d":
            tensors[key] = tensor.to(torch.bool)
        else:
            tensors[key] = tensor.detach().to(dtype)
        tensors[key] = tensors[key].cpu().contiguous()
    config = checkpoint_config(model.config, dtype)
    config.update(extra_config or {})

    return write_checkpoint(out_dir, tensors, config)


def write_checkpoint(out_dir: Path, tensors: dict, config: dict, metadata: dict | None = None) -> Path:
    """`model.safetensors` then `config.json`, each atomically: weights first, config last, so a
    folder with a config.json has its weights (every checkpoint and export is written so)."""
    out_dir = Path(out_dir)
    with atomic_path(out_dir / WEIGHTS_NAME) as tmp:
        save_file(tensors, str(tmp), metadata=metadata or {"format": "pt"})
    atomic_write_text(json.dumps(config, indent=2) + "\n", out_dir / CONFIG_NAME)
    return out_dir


def config_from_checkpoint(config: dict) -> DrafterConfig:
    """DrafterConfig from an official EAGLE-3 config.json."""
    try:
        aux = config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids") or config.get(
            "eagle_aux_hidden_state_layer_ids", []
        )
        rope_theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta")
        return DrafterConfig(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
            head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
            rms_norm_eps=config["rms_norm_eps"],
            rope_theta=float(rope_theta),
            max_position_embeddings=config["max_position_embeddings"],
            vocab_size=config["vocab_size"],
            draft_vocab_size=config["draft_vocab_size"],
            target_hidden_size=config.get("target_hidden_size") or config["hidden_size"],
            aux_layer_ids=list(aux),
            hidden_act=config.get("hidden_act", "silu"),
        )
    except KeyError as e:
        raise ValueError(f"drafter config.json lacks required field {e.args[0]!r}") from e


def load_checkpoint(
    checkpoint_dir: str | Path,
    embed_tokens_weight: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> Eagle3Drafter:
    """Load a drafter written by `save_checkpoint` (or an official EAGLE-3 checkpoint).

    Every contract key must be present with its contract shape; the error names the first
    key that is missing, unexpected or mis-shaped. Weights are cast to `dtype`.
    """
    checkpoint_dir = Path(checkpoint_dir)
    config_path, weights_path = checkpoint_dir / CONFIG_NAME, checkpoint_dir / WEIGHTS_NAME
    for path in (config_path, weights_path):
        if not path.exists():
            raise FileNotFoundError(f"drafter checkpoint incomplete: {path} does not exist")
    raw_config = json.loads(config_path.read_text())
    if CHECKPOINT_ARCHITECTURE not in raw_config.get("architectures", []):
        raise ValueError(
            f"{config_path}: architectures is {raw_config.get('architectures')}, expected [{CHECKPOINT_ARCHITECTURE!r}]"
        )
    config = config_from_checkpoint(raw_config)
    shapes = expected_shapes(config)
    tensors = {}
    with safe_open(str(weights_path), framework="pt") as f:
        keys = set(f.keys())
        for key in sorted(shapes):
            if key not in keys:
                raise ValueError(f"{weights_path}: missing key {key!r}")
            tensor = f.get_tensor(key)
            if tuple(tensor.shape) != shapes[key]:
                raise ValueError(
                    f"{weights_path}: key {key!r} has shape {tuple(tensor.shape)}, expected {shapes[key]}"
                )
            tensors[key] = tensor
        # Official checkpoints may carry the embeddings; the target's are used instead.
        unexpected = sorted(keys - set(shapes) - {"embed_tokens.weight"})
        if unexpected:
            raise ValueError(f"{weights_path}: unexpected key {unexpected[0]!r} (all unexpected: {unexpected})")
    model = Eagle3Drafter(config, embed_tokens_weight)
    model.load_state_dict(tensors, strict=True)
    return model.to(dtype)
