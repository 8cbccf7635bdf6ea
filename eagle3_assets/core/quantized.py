"""Quantized checkpoints, kept quantized in memory: INT4 experts as Kimi-K2 ships them, FP8 blocks as
DeepSeek-V3 ships them. Each weight is dequantized just before use (a projection per call, a
layer's routed experts per MoE call, in chunks of `experts_per_chunk`), so the memory held is the
checkpoint's size, not bf16's (Kimi-K2.5: about 0.6 TB in INT4 against about 2 TB in bf16).

Formats (the tensors are named as the checkpoints name them, so a module's state dict is the
checkpoint's):

- INT4, compressed-tensors "pack-quantized" (quant_method "compressed-tensors", symmetric int,
  strategy "group", Kimi-K2: group size 32, routed experts only): `weight_packed` int32
  [out, in/8], eight 4-bit values per int32, value 8j+i of a row in bits 4i..4i+3 of its column j,
  each stored as q + 8 (unsigned); `weight_scale` [out, in/group] (bf16 in Kimi-K2);
  `weight_shape` int [2]. The weight is q * scale of its group of `group_size` input columns.
- FP8, DeepSeek-V3 (quant_method "fp8", weight_block_size [128, 128], every linear layer of the
  decoder layers but the router): `weight` float8_e4m3fn [out, in] and `weight_scale_inv` float32
  [ceil(out/128), ceil(in/128)]; the weight is weight * weight_scale_inv of its 128x128 block.

`load_quantized_base` builds the base model from its config with no weights (meta device), puts
`QuantLinear` / `QuantExperts` where the checkpoint holds quantized tensors, and reads every
tensor from the safetensors files: no transformers quantizer, no bf16 copy of the experts.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


class QuantizedCheckpointError(ValueError):
    pass


@dataclass(frozen=True)
class Int4Group:
    """compressed-tensors pack-quantized: symmetric 4-bit integers, one scale per `group_size` inputs."""

    group_size: int = 32
    suffixes = ("weight_packed", "weight_scale", "weight_shape")

    @property
    def name(self) -> str:
        return f"int4 (compressed-tensors pack-quantized, symmetric, group {self.group_size})"

    def quantize(self, w: torch.Tensor, scale_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """What compressed-tensors writes for `w` [..., out, in]: a min-max symmetric scale per group
        (absmax / 7.5, as its observer computes it), q = round(w / scale) clamped to [-8, 7]."""
        *lead, out_f, in_f = w.shape
        if in_f % self.group_size or in_f % 8:
            raise QuantizedCheckpointError(f"int4 group quantization needs the input size ({in_f}) to be a multiple of "
                                           f"the group size ({self.group_size}) and of 8")
        g = w.float().reshape(*lead, out_f, in_f // self.group_size, self.group_size)
        scale = (g.abs().amax(-1) / 7.5).clamp(min=1e-8).to(scale_dtype)
        u = (torch.round(g / scale.float()[..., None]).clamp(-8, 7) + 8).to(torch.int64).view(*lead, out_f, in_f // 8, 8)
        del g
        packed = torch.zeros(*lead, out_f, in_f // 8, dtype=torch.int64, device=w.device)
        for i in range(8):
            packed |= u[..., i] << (4 * i)
        packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # the uint32 bits read as int32
        shape = torch.tensor([out_f, in_f], dtype=torch.int32, device=w.device).expand(*lead, 2).contiguous()
        return {"weight_packed": packed, "weight_scale": scale, "weight_shape": shape}

    def dequantize(self, t: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """[..., out, in] in `dtype` from [..., out, in/8] packed and [..., out, in/group] scales
        (a leading dimension stacks experts). q * scale is exact in float32 and rounded once to
        bf16, as compressed-tensors' bf16 product is."""
        packed, scale = t["weight_packed"], t["weight_scale"]
        *lead, out_f, cols = packed.shape
        in_f = cols * 8
        # Byte j of a little-endian int32 holds values 2j (low nibble) and 2j+1: unpacking bytes
        # moves a quarter of the bytes that shifting whole int32s would.
        b = packed.contiguous().view(torch.uint8)
        q = torch.stack((b & 15, b >> 4), dim=-1).view(torch.int8) - 8  # [..., out, in/2, 2]
        w = q.view(*lead, out_f, in_f // self.group_size, self.group_size).to(dtype) * scale.to(dtype)[..., None]
        return w.view(*lead, out_f, in_f)

    def param_shapes(self, out_f: int, in_f: int, scale_dtype: torch.dtype) -> dict[str, tuple[tuple, torch.dtype]]:
        return {"weight_packed": ((out_f, in_f // 8), torch.int32),
                "weight_scale": ((out_f, in_f // self.group_size), scale_dtype),
                "weight_shape": ((2,), torch.int32)}

    def config(self, ignore: list[str]) -> dict:
        """The `quantization_config` of a Kimi-K2-style checkpoint."""
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                              "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                          "strategy": "group", "group_size": self.group_size,
                                                          "dynamic": False, "actorder": None, "observer": "minmax"}}},
                "ignore": ignore, "kv_cache_scheme": None}


@dataclass(frozen=True)
class Fp8Block:
    """DeepSeek-V3's FP8: float8_e4m3fn weights, one float32 scale per block of rows x columns."""

    block: tuple[int, int] = (128, 128)
    suffixes = ("weight", "weight_scale_inv")

    @property
    def name(self) -> str:
        return f"fp8 (float8_e4m3fn, {self.block[0]}x{self.block[1]} blocks)"

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        """[..., out, in] zero-padded to whole blocks, viewed [..., out/b0, b0, in/b1, b1]."""
        b0, b1 = self.block
        *lead, o, i = x.shape
        po, pi = -o % b0, -i % b1
        if po or pi:
            x = F.pad(x, (0, pi, 0, po))
        return x.reshape(*lead, (o + po) // b0, b0, (i + pi) // b1, b1)

    def quantize(self, w: torch.Tensor, scale_dtype=None) -> dict[str, torch.Tensor]:
        """DeepSeek-V3's block quantization of `w` [..., out, in]: scale = the block's absmax / 448."""
        *lead, o, i = w.shape
        blocks = self._blocks(w.float())
        scale = (blocks.abs().amax(dim=(-3, -1)) / FP8_MAX).clamp(min=1e-12)  # [..., o/b0, i/b1]
        q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
        q = q.reshape(*lead, blocks.shape[-4] * self.block[0], -1)
        return {"weight": q[..., :o, :i].to(torch.float8_e4m3fn).contiguous(), "weight_scale_inv": scale.contiguous()}

    def dequantize(self, t: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """weight * weight_scale_inv of its block in float32, rounded once to `dtype` (DeepSeek's
        weight_dequant)."""
        w, s = t["weight"], t["weight_scale_inv"]
        *lead, o, i = w.shape
        blocks = self._blocks(w.to(torch.float32))
        out = (blocks * s[..., :, None, :, None]).to(dtype)
        return out.reshape(*lead, blocks.shape[-4] * self.block[0], -1)[..., :o, :i]

    def param_shapes(self, out_f: int, in_f: int, scale_dtype: torch.dtype = torch.float32):
        b0, b1 = self.block
        return {"weight": ((out_f, in_f), torch.float8_e4m3fn),
                "weight_scale_inv": ((math.ceil(out_f / b0), math.ceil(in_f / b1)), torch.float32)}

    def config(self, ignore: list[str] | None = None) -> dict:
        """The `quantization_config` of DeepSeek-V3's checkpoint."""
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(self.block)}


def scheme_of(quantization_config: dict | None) -> Int4Group | Fp8Block | None:
    """The format of a checkpoint's `quantization_config`, or None when it has none; a clear error
    for anything else (another bit width, asymmetric, activation quantization...)."""
    qc = quantization_config
    if not qc:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if not block or len(block) != 2:
            raise QuantizedCheckpointError(f"fp8 checkpoint without a 2-D weight_block_size ({block}): only "
                                           "DeepSeek-V3's block-scaled FP8 is supported")
        return Fp8Block(tuple(int(b) for b in block))
    if method == "compressed-tensors":
        groups = list((qc.get("config_groups") or {}).values())
        fmt = qc.get("format")
        if fmt != "pack-quantized" or len(groups) != 1:
            raise QuantizedCheckpointError(f"compressed-tensors checkpoint in format {fmt!r} with {len(groups)} config "
                                           "group(s): only one pack-quantized group (Kimi-K2's INT4) is supported")
        w = groups[0].get("weights") or {}
        ok = (w.get("num_bits") == 4 and w.get("type", "int") == "int" and w.get("symmetric") is True
              and w.get("strategy") == "group" and groups[0].get("input_activations") is None)
        if not ok:
            raise QuantizedCheckpointError(f"compressed-tensors weights {w}: only symmetric 4-bit integer groups with "
                                           "unquantized activations (Kimi-K2's INT4) are supported")
        return Int4Group(int(w["group_size"]))
    raise QuantizedCheckpointError(f"quantization method {method!r} is not supported (supported: compressed-tensors "
                                   "pack-quantized INT4, DeepSeek-V3 block FP8)")


def _meta(shape, dtype):
    return torch.empty(shape, dtype=dtype, device="meta")


class QuantLinear(nn.Module):
    """A linear layer whose weight stays quantized; `dequantized(dtype)` gives [out, in] for one call."""

    def __init__(self, scheme, in_features: int, out_features: int, bias: torch.Tensor | None, scale_dtype):
        super().__init__()
        self.scheme, self.in_features, self.out_features = scheme, in_features, out_features
        for name, (shape, dtype) in scheme.param_shapes(out_features, in_features, scale_dtype).items():
            self.register_buffer(name, _meta(shape, dtype))
        self.bias = bias

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return self.scheme.dequantize({k: getattr(self, k) for k in self.scheme.suffixes}, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized(x.dtype), self.bias)


class _Stacked(nn.Module):
    """One projection of every expert, quantized, stacked on a leading expert dimension."""

    def __init__(self, scheme, experts: int, in_features: int, out_features: int, scale_dtype, first: int = 0):
        super().__init__()
        self.scheme, self.first = scheme, first  # `first`: the checkpoint's number of expert 0 here
        for name, (shape, dtype) in scheme.param_shapes(out_features, in_features, scale_dtype).items():
            self.register_buffer(name, _meta((experts, *shape), dtype))

    def dequantized(self, e0: int, e1: int, dtype: torch.dtype) -> torch.Tensor:
        return self.scheme.dequantize({k: getattr(self, k)[e0:e1] for k in self.scheme.suffixes if k != "weight_shape"},
                                      dtype)


class QuantExperts(nn.Module):
    """A layer's routed experts, quantized (in place of transformers' fused [E, 2I, H] / [E, H, I]
    experts). `weights(e0, e1, dtype)` dequantizes experts e0..e1-1 for one MoE call; called
    like transformers' experts module, it runs `moe.routed_experts`. With `expert_range` (lo, hi)
    it holds experts lo..hi-1 of `num_experts` only (expert parallel: each rank of a group holds
    its share, and `routed_experts` sums the ranks' rows); expert numbers stay the layer's."""

    def __init__(self, scheme, num_experts: int, hidden: int, intermediate: int, scale_dtype, experts_per_chunk=None,
                 expert_range: tuple[int, int] | None = None):
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden, intermediate
        self.expert_range = expert_range or (0, num_experts)
        lo, hi = self.expert_range
        self.experts_per_chunk = experts_per_chunk or num_experts
        self.gate_proj = _Stacked(scheme, hi - lo, hidden, intermediate, scale_dtype, lo)
        self.up_proj = _Stacked(scheme, hi - lo, hidden, intermediate, scale_dtype, lo)
        self.down_proj = _Stacked(scheme, hi - lo, intermediate, hidden, scale_dtype, lo)

    def weights(self, e0: int, e1: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        e0, e1 = e0 - self.expert_range[0], e1 - self.expert_range[0]
        gate_up = torch.cat((self.gate_proj.dequantized(e0, e1, dtype), self.up_proj.dequantized(e0, e1, dtype)), dim=1)
        return gate_up, self.down_proj.dequantized(e0, e1, dtype)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        from .moe import routed_experts

        return routed_experts(self, hidden_states, top_k_index, top_k_weights)


def expert_share(num_experts: int, rank: int, world: int) -> tuple[int, int]:
    """Rank `rank`'s experts of `world` ranks: a contiguous range, the sizes differing by one at most."""
    return rank * num_experts // world, (rank + 1) * num_experts // world


# ---------------------------------------------------------------------------------------------
# Loading


class _Checkpoint:
    """The safetensors files of a folder: each tensor's file, shape and dtype, read lazily."""

    def __init__(self, model_dir: Path):
        from safetensors import safe_open

        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise QuantizedCheckpointError(f"{model_dir} has no *.safetensors: quantized checkpoints load from safetensors")
        self.handles = [safe_open(str(f), "pt") for f in files]
        self.where = {k: h for h in self.handles for k in h.keys()}

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def meta(self, key: str) -> tuple[list[int], torch.dtype]:
        s = self.where[key].get_slice(key)
        return s.get_shape(), _SAFETENSORS_DTYPES[s.get_dtype()]

    def get(self, key: str) -> torch.Tensor:
        return self.where[key].get_tensor(key)


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I32": torch.int32,
                       "I64": torch.int64, "F8_E4M3": torch.float8_e4m3fn, "U8": torch.uint8, "I8": torch.int8,
                       "BOOL": torch.bool}


def checkpoint_tensor_bytes(model_dir: str | Path) -> dict[str, int]:
    """Bytes of the checkpoint's tensors (from the safetensors headers, nothing read): "total",
    "routed_experts" (the `mlp.experts.*` tensors), "embeddings_and_head" (embed_tokens, lm_head)
    and "other"; what `eagle3 plan` spreads over the GPUs."""
    ck = _Checkpoint(Path(model_dir))
    out = {"total": 0, "routed_experts": 0, "embeddings_and_head": 0, "other": 0}
    for key in ck.where:
        shape, dtype = ck.meta(key)
        n = math.prod(shape) * dtype.itemsize
        part = ("routed_experts" if ".mlp.experts." in key else
                "embeddings_and_head" if key.endswith(("embed_tokens.weight", "lm_head.weight")) else "other")
        out[part] += n
        out["total"] += n
    return out


def _is_experts(module) -> bool:
    p = getattr(module, "_parameters", {})
    return (p.get("gate_up_proj") is not None and p.get("down_proj") is not None and p["gate_up_proj"].dim() == 3
            and not getattr(module, "is_transposed", False) and not getattr(module, "has_bias", False))


def load_quantized_base(model_dir: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu",
                        experts_per_chunk: int | None = None, expert_shard: tuple[int, int] | None = None):
    """The base model (transformers' AutoModel, no LM head) of a quantized checkpoint, its quantized
    tensors kept as stored on `device` and the rest in `dtype`. `model.quantization` names the
    format and `model.config` no longer carries a `quantization_config` (nothing else reads it).
    `expert_shard` (rank, world): this rank of a torch.distributed group reads and holds only its
    share of each layer's routed experts (`expert_share`), the rest whole: a 1T-parameter MoE's
    experts are nearly all of its bytes, so each GPU of 8 holds about an eighth."""
    from transformers import AutoConfig, AutoModel

    model_dir, device = Path(model_dir), torch.device(device)
    config = AutoConfig.from_pretrained(model_dir)
    raw = json.loads((model_dir / "config.json").read_text()).get("quantization_config")
    scheme = scheme_of(raw)
    if scheme is None:
        raise QuantizedCheckpointError(f"{model_dir} has no quantization_config: load it as a plain model")
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    ck = _Checkpoint(model_dir)
    with torch.device("meta"):
        model = AutoModel.from_config(config, dtype=dtype)
    prefix = "model." if any(k.startswith("model.layers.") for k in ck.where) else ""
    quant_key = scheme.suffixes[0] if isinstance(scheme, Int4Group) else "weight_scale_inv"
    replaced = 0
    for name, module in list(model.named_modules()):
        key = prefix + name
        if type(module) is nn.Linear and f"{key}.{quant_key}" in ck:
            scale_dtype = ck.meta(f"{key}.{scheme.suffixes[1]}")[1]
            new = QuantLinear(scheme, module.in_features, module.out_features, module.bias, scale_dtype)
        elif _is_experts(module) and f"{key}.0.gate_proj.{quant_key}" in ck:
            e, two_i, h = module.gate_up_proj.shape
            scale_dtype = ck.meta(f"{key}.0.gate_proj.{scheme.suffixes[1]}")[1]
            new = QuantExperts(scheme, e, h, two_i // 2, scale_dtype, experts_per_chunk,
                               expert_share(e, *expert_shard) if expert_shard else None)
        else:
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        replaced += 1
    if not replaced:
        raise QuantizedCheckpointError(f"{model_dir}: its config says {scheme.name} but no tensor of the base model "
                                       f"is stored that way (no *.{quant_key})")
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if "rotary_emb" in owner_name:
            continue  # not in checkpoints: recomputed below
        value = _read(ck, prefix + owner_name, attr, owner, tensor)
        if tensor.dtype.is_floating_point and tensor.dtype not in (torch.float8_e4m3fn,) and value.dtype != tensor.dtype:
            value = value.to(tensor.dtype)
        if tuple(value.shape) != tuple(tensor.shape):
            raise QuantizedCheckpointError(f"{prefix + name}: checkpoint shape {tuple(value.shape)}, model expects "
                                           f"{tuple(tensor.shape)}")
        value = value.to(device)
        if attr in owner._parameters:
            owner._parameters[attr] = nn.Parameter(value, requires_grad=False)
        else:
            owner._buffers[attr] = value
    # The rotary embedding's inverse frequencies are computed from the config, never stored.
    with torch.device("cpu"):  # (built outside the meta context, then moved)
        model.rotary_emb = type(model.rotary_emb)(model.config).to(device)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise QuantizedCheckpointError(f"{model_dir}: not in the checkpoint: {left[:5]}")
    model.quantization = scheme.name
    return model.eval()


def _read(ck: _Checkpoint, owner_key: str, attr: str, owner, like: torch.Tensor) -> torch.Tensor:
    """One tensor of the model from the checkpoint: as stored, or stacked over the experts
    (quantized experts' per-expert tensors, or plain per-expert weights into transformers'
    fused [E, 2I, H] / [E, H, I])."""
    key = f"{owner_key}.{attr}"
    if key in ck:
        return ck.get(key)
    if isinstance(owner, _Stacked):
        experts_key, _, proj = owner_key.rpartition(".")
        out = torch.empty(like.shape, dtype=like.dtype)
        for e in range(like.shape[0]):
            out[e] = ck.get(f"{experts_key}.{owner.first + e}.{proj}.{attr}")
        return out
    if _is_experts(owner) and attr in ("gate_up_proj", "down_proj"):
        out = torch.empty(like.shape, dtype=like.dtype)
        for e in range(like.shape[0]):
            out[e] = (torch.cat([ck.get(f"{owner_key}.{e}.gate_proj.weight"), ck.get(f"{owner_key}.{e}.up_proj.weight")])
                      if attr == "gate_up_proj" else ck.get(f"{owner_key}.{e}.down_proj.weight"))
        return out
    raise QuantizedCheckpointError(f"the checkpoint has no {key}")


def quantize_experts(base_model, scheme, scale_dtype: torch.dtype = torch.bfloat16, experts_per_chunk=None) -> int:
    """Replace each layer's transformers experts ([E, 2I, H] and [E, H, I]) by `QuantExperts` holding
    them quantized as `scheme` stores them, on their device, layer by layer: a quantized target
    without a checkpoint written (the benchmark's INT4 variant). Returns how many were replaced."""
    n = 0
    for name, module in list(base_model.named_modules()):
        if not _is_experts(module):
            continue
        e, two_i, h = module.gate_up_proj.shape
        inter = two_i // 2
        q = QuantExperts(scheme, e, h, inter, scale_dtype, experts_per_chunk)
        with torch.no_grad():
            for proj, w in (("gate_proj", module.gate_up_proj[:, :inter]), ("up_proj", module.gate_up_proj[:, inter:]),
                            ("down_proj", module.down_proj)):
                for key, value in scheme.quantize(w, scale_dtype).items():
                    setattr(getattr(q, proj), key, value)
        parent, _, child = name.rpartition(".")
        setattr(base_model.get_submodule(parent), child, q)
        del module
        n += 1
    return n


def held_bytes(model) -> int:
    """Bytes of every parameter and buffer of a loaded model: what its weights hold in memory."""
    seen, n = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            n += t.numel() * t.element_size()
    return n


# ---------------------------------------------------------------------------------------------
# Writing quantized checkpoints (tests and the benchmark: a random model in the shipped formats)


_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
_LAYER_LINEAR = re.compile(r"^model\.layers\.\d+\..*_proj(_with_mqa)?\.weight$")


def quantize_checkpoint(src_dir: str | Path, out_dir: str | Path, scheme, dequantized_dir: str | Path | None = None,
                        scale_dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write `src_dir`'s model (a saved transformers checkpoint) quantized as it ships: Int4Group
    quantizes the routed experts only (Kimi-K2's ignore list keeps attention, dense and shared
    MLPs, router and head in bf16), Fp8Block every projection of the decoder layers (DeepSeek-V3:
    not the router, norms, embeddings or head). With `dequantized_dir`, also the same model with
    those weights dequantized, as a plain checkpoint: the reference its forward must equal."""
    import shutil

    from safetensors.torch import save_file

    src, out = Path(src_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ck = _Checkpoint(src)
    which = _EXPERT if isinstance(scheme, Int4Group) else _LAYER_LINEAR
    quantized, plain = {}, {}
    for key in sorted(ck.where):
        t = ck.get(key)
        if which.search(key) and t.dim() == 2:
            q = scheme.quantize(t, scale_dtype)
            base = key[: -len(".weight")]
            quantized.update({f"{base}.{k}": v for k, v in q.items()})
            plain[key] = scheme.dequantize(q, torch.float32).to(t.dtype).contiguous()
        else:
            quantized[key] = plain[key] = t
    save_file(quantized, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    ignore = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]
    config["quantization_config"] = scheme.config(ignore)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if dequantized_dir is not None:
        ref = Path(dequantized_dir)
        ref.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.is_file() and f.suffix != ".safetensors":
                shutil.copy(f, ref / f.name)
        save_file(plain, str(ref / "model.safetensors"), metadata={"format": "pt"})
    return out


def predict_checkpoint_bytes(config, scheme=None, dtype_bytes: int = 2) -> dict[str, int]:
    """The bytes `checkpoint_tensor_bytes` would count for a checkpoint of `config` stored as it ships
    (`quantize_checkpoint`'s rules; `scheme` None: every tensor in `dtype_bytes`), from a weightless
    (meta) model of the config: no checkpoint needed (the plan of a model not yet downloaded)."""
    from transformers import AutoModelForCausalLM

    config = config.__class__.from_dict(config.to_dict())
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    out = {"total": 0, "routed_experts": 0, "embeddings_and_head": 0, "other": 0}
    for name, p in model.named_parameters():
        shapes = [tuple(p.shape[1:])] * p.shape[0] if _is_experts(model.get_submodule(name.rpartition(".")[0])) else [tuple(p.shape)]
        routed = ".mlp.experts." in name
        if routed and name.endswith("gate_up_proj"):  # stored per expert as gate_proj and up_proj
            shapes = [(s[0] // 2, s[1]) for s in shapes for _ in range(2)]
        linear = len(shapes[0]) == 2 and (routed or bool(_LAYER_LINEAR.search(name.replace(".gate_up_proj", ".gate_proj.weight"))))
        quantized = scheme is not None and linear and (routed or isinstance(scheme, Fp8Block))
        n = 0
        for shape in shapes:
            if not quantized:
                n += math.prod(shape) * (4 if name.endswith("e_score_correction_bias") else dtype_bytes)
            else:
                n += sum(math.prod(s) * d.itemsize for s, d in scheme.param_shapes(*shape, torch.bfloat16).values())
        part = "routed_experts" if routed else "embeddings_and_head" if name.endswith(
            ("embed_tokens.weight", "lm_head.weight")) else "other"
        out[part] += n
        out["total"] += n
    for name, b in model.named_buffers():  # persistent buffers are stored (DeepSeek's correction bias)
        if name.endswith("e_score_correction_bias"):
            out["other"] += b.numel() * 4
            out["total"] += b.numel() * 4
    return out
