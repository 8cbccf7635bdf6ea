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


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


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


class Eagle3MLP(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = getattr(F, config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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

    forward = ttt_forward

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
