"""Serving formats for the EAGLE-3 drafter: the `speculators` layout, engine-specific configs,
and a validator that says what an engine would get wrong before it silently gets it wrong.

Our checkpoint (`drafter.save_checkpoint`, the drafter checkpoint contract) is the
official EAGLE-3 layout: `config.json` (`architectures: ["LlamaForCausalLMEagle3"]`) and
`model.safetensors` with `fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`,
`t2d`; aux layer ids in the Hugging Face `hidden_states` convention (0 = embeddings, j = output
of decoder layer j-1) under `eagle_config.eagle_aux_hidden_state_layer_ids`.

How the engines read it (source read for this module; paths are in the public repositories):

- vLLM, `vllm-project/vllm`:
  * `vllm/model_executor/models/llama_eagle3.py` (`Eagle3LlamaForCausalLM.load_weights`,
    `LlamaModel.load_weights`): skips `t2d`; renames `d2t` to the `draft_id_to_target_id`
    parameter (target id = arange + d2t, applied in `compute_logits`, which scatters the
    draft logits into the full target vocabulary); prefixes everything but `lm_head` with
    `model.`; renames `midlayer.` to `layers.0.`; stacks q/k/v into `qkv_proj` and gate/up into
    `gate_up_proj`; `embed_tokens` optional (the target's are shared when absent); `fc` input is
    `3 * target_hidden_size` (falls back to `3 * hidden_size`), no bias; a missing
    `draft_vocab_size` silently defaults to `vocab_size`; `norm_before_residual` defaults to
    False for this layout. A weight it has no parameter for: the tree read (commit 00bd149)
    hands it to `LlamaModel.load_weights`, whose `params_dict[name]` raises KeyError (an
    `fc.bias`, say); issue 16 reports that vLLM 0.33 ignores it instead. Either way the drafter
    vLLM serves is not the trained one, so the validator refuses any unexpected weight.
    A full-vocabulary drafter (`draft_vocab_size == vocab_size`): newer trees build no
    `draft_id_to_target_id` at all (`if draft_vocab_size != target_vocab_size: ... else: None`,
    as in the DFlash and Eagle3 variants of 2026), so a `d2t` in the weights has nowhere to go
    and the load fails; without `d2t` every version loads (`skip_substrs` then skips the map,
    which older trees leave at zeros: the identity). Our vLLM copies of such a drafter carry
    neither `d2t` nor `t2d`.
  * `vllm/v1/worker/gpu_model_runner.py` (`_get_eagle3_aux_layers_from_config`, in newer trees
    `get_eagle3_aux_layers_from_config`): reads the draft config's TOP-LEVEL
    `eagle_aux_hidden_state_layer_ids` first; some versions then fall back to
    `eagle_config["eagle_aux_hidden_state_layer_ids"]`, others do not and use the target's
    default `(2, N//2, N-3)`. The ids are used as given in the HF `hidden_states` convention
    (the target appends `hidden_states + residual` before running layer `idx`).
  * `vllm/transformers_utils/configs/speculators/{base,algos}.py`: the `speculators` adapter.
    It requires `speculators_model_type`, `transformer_layer_config` (a dict, becomes the HF
    config), `speculators_config.proposal_methods[0].speculative_tokens` and
    `speculators_config.verifier.name_or_path` (the target vLLM resolves: a Hugging Face id
    `org/name` or a path; never our `embedded:` names); `update_eagle3` copies `draft_vocab_size`,
    `target_hidden_size`, `eagle_aux_hidden_state_layer_ids` and `norm_before_residual` —
    which DEFAULTS TO TRUE there when absent (speculators' own default is False), so it must be
    written explicitly.
- SGLang, `sgl-project/sglang`:
  * `python/sglang/srt/models/llama_eagle3.py` (`LlamaForCausalLMEagle3.load_weights`): `d2t`
    becomes `hot_token_id = d2t + arange` (target id of each draft id), `t2d` skipped, names not
    found are SKIPPED SILENTLY, q/k/v and gate/up stacked. Its first layer: in the tree read
    (commit 03d5a77) the module is `model.midlayer` (built with the prefix `midlayers.0`), so
    the checkpoint's `midlayer.*` names load as they are; issue 16 reports that 0.5.23 renames
    them on load. Either way our `midlayer.*` names load, and other names (the speculators
    layout's `layers.0.*`) would be skipped silently, which the validator catches as missing
    weights. `fc` is `nn.Linear(3 * target_hidden_size, hidden_size, bias=config.bias)`: an
    `fc.bias` loads only with `bias: true` in the config and is skipped otherwise.
    `tie_word_embeddings: true` makes `lm_head` the embeddings; `draft_vocab_size: null` loads
    the target's full lm_head instead.
  * `python/sglang/srt/model_executor/model_runner.py`: reads ONLY
    `eagle_config["eagle_aux_hidden_state_layer_ids"]` of the draft config and passes it to the
    target's `set_eagle3_layers_to_capture` (`python/sglang/srt/models/llama.py`), which captures
    at `id + 1` ("+1 because sglang captures the INPUT to the layer"): SGLang ids count "output
    of decoder layer X" (0-based) = HF index - 1. With no ids it captures `[2, N//2, N-3]`
    directly (HF convention). See `sglang_layer_ids`.
- speculators, `vllm-project/speculators`: `src/speculators/models/eagle3/config.py`
  (`Eagle3SpeculatorConfig`), `src/speculators/config.py` (`SpeculatorsConfig`,
  `VerifierConfig`), `src/speculators/proposals/greedy.py` (`GreedyTokenProposalConfig`),
  `src/speculators/models/eagle3.py` / `eagle3/core.py` (module names `embed_tokens`, `fc`,
  `layers.0.*`, `norm`, `lm_head`, buffers `d2t`, `t2d`), and
  `src/speculators/convert/eagle/eagle3_converter.py` (the official-to-speculators conversion:
  `midlayer.` -> `layers.0.`, adds the verifier's `embed_tokens.weight`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open

from eagle3_assets.core.drafter import (
    CHECKPOINT_ARCHITECTURE,
    CONFIG_NAME,
    WEIGHTS_NAME,
    config_from_checkpoint,
    expected_shapes,
    write_checkpoint,
)
from eagle3_assets.core.target import load_target_head

Engine = Literal["vllm", "sglang"]

SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
SPECULATORS_MODEL_TYPE = "eagle3"

# Our own config key naming the convention of the aux layer ids written in that config.
# Engines ignore unknown keys; the validator reads it. Absent = HF_CONVENTION (the contract).
CONVENTION_KEY = "aux_layer_id_convention"
HF_CONVENTION = "hf_hidden_states"  # 0 = embeddings, j = output of decoder layer j-1
SGLANG_CONVENTION = "layer_output"  # X = output of decoder layer X (0-based) = HF index - 1
ENGINE_CONVENTION = {"vllm": HF_CONVENTION, "sglang": SGLANG_CONVENTION}


# ---------------------------------------------------------------------------------------------
# Layer-id conventions
# ---------------------------------------------------------------------------------------------


def sglang_layer_ids(hf_ids: list[int]) -> list[int]:
    """HF `hidden_states` indices -> the ids SGLang expects in
    `eagle_config.eagle_aux_hidden_state_layer_ids`: `[i - 1 for i in hf_ids]`.

    SGLang (`sgl-project/sglang`, `python/sglang/srt/models/llama.py`,
    `LlamaForCausalLM.set_eagle3_layers_to_capture`) sets `layers_to_capture = [val + 1 for val
    in layer_ids]` and captures the input of each such layer, i.e. id X reads the output of
    decoder layer X = HF `hidden_states[X + 1]`. Some SGLang versions and forks change this
    shift (sgl-project/sglang PR 25454); check the deployed version's
    `set_eagle3_layers_to_capture` before serving. HF index 0 (the embeddings) has no
    non-negative SGLang id and is rejected.
    """
    ids = [int(i) for i in hf_ids]
    if any(i < 1 for i in ids):
        raise ValueError(f"HF hidden_states index 0 (the embeddings) has no SGLang layer id; got {ids}")
    return [i - 1 for i in ids]


def hf_layer_ids_from_sglang(sglang_ids: list[int]) -> list[int]:
    """Inverse of `sglang_layer_ids`."""
    return [int(i) + 1 for i in sglang_ids]


def _hf_ids_of(config: dict) -> list[int] | None:
    """The aux layer ids of a config in the HF convention, whatever convention it declares."""
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return None
    if config.get(CONVENTION_KEY, HF_CONVENTION) == SGLANG_CONVENTION:
        return hf_layer_ids_from_sglang(ids)
    return [int(i) for i in ids]


def engine_config(config: dict, engine: Engine) -> dict:
    """An official-layout config.json rewritten for one engine.

    vllm: ids (HF convention) at the top level, which every vLLM version reads first, and in
    `eagle_config`. sglang: `eagle_config` ids converted with `sglang_layer_ids` (the only place
    SGLang reads), no top-level copy. Both record the convention under `CONVENTION_KEY`.
    """
    if engine not in ENGINE_CONVENTION:
        raise ValueError(f"engine must be 'vllm' or 'sglang'; got {engine!r}")
    hf_ids = _hf_ids_of(config)
    if hf_ids is None:
        raise ValueError("config has no eagle_aux_hidden_state_layer_ids (top level or in eagle_config)")
    out = json.loads(json.dumps(config))
    eagle = dict(out.get("eagle_config") or {})
    eagle.setdefault("use_aux_hidden_state", True)
    if engine == "vllm":
        eagle["eagle_aux_hidden_state_layer_ids"] = hf_ids
        out["eagle_aux_hidden_state_layer_ids"] = hf_ids
    else:
        eagle["eagle_aux_hidden_state_layer_ids"] = sglang_layer_ids(hf_ids)
        out.pop("eagle_aux_hidden_state_layer_ids", None)
    out["eagle_config"] = eagle
    out[CONVENTION_KEY] = ENGINE_CONVENTION[engine]
    return out


def full_vocab(config: dict) -> bool:
    """A drafter over the target's whole vocabulary: its d2t is the identity."""
    return config.get("draft_vocab_size") is not None and config.get("draft_vocab_size") == config.get("vocab_size")


def _without_vocab_map(tensors: dict[str, torch.Tensor], where: Path) -> dict[str, torch.Tensor]:
    """The weights of a full-vocabulary drafter as vLLM loads them: no d2t (vLLM has no place for
    it, see the module doc) and no t2d (skipped anyway)."""
    d2t = tensors.get("d2t")
    if d2t is not None and bool(d2t.to(torch.int64).any()):
        raise ValueError(f"{where}: draft_vocab_size equals vocab_size but d2t is not the identity (all zeros)")
    return {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}


def write_engine_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path, engine: Engine) -> Path:
    """Copy a drafter checkpoint with its config rewritten by `engine_config` (weights first,
    config last, each through a temporary name). vLLM's copy of a full-vocabulary drafter
    leaves out d2t and t2d (`_without_vocab_map`)."""
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    config = json.loads((checkpoint_dir / CONFIG_NAME).read_text())
    new_config = engine_config(config, engine)
    out_dir.mkdir(parents=True, exist_ok=True)
    with safe_open(str(checkpoint_dir / WEIGHTS_NAME), framework="pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    if engine == "vllm" and full_vocab(config):
        tensors = _without_vocab_map(tensors, checkpoint_dir)
    return write_checkpoint(out_dir, tensors, new_config, metadata)


# ---------------------------------------------------------------------------------------------
# speculators export
# ---------------------------------------------------------------------------------------------


def _read_checkpoint(checkpoint_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json and all tensors of an official-layout checkpoint, checked against the
    contract (every key present with its shape)."""
    config = json.loads((checkpoint_dir / CONFIG_NAME).read_text())
    shapes = expected_shapes(config_from_checkpoint(config))
    with safe_open(str(checkpoint_dir / WEIGHTS_NAME), framework="pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    for key, shape in shapes.items():
        if key not in tensors:
            raise ValueError(f"{checkpoint_dir}: missing key {key!r}")
        if tuple(tensors[key].shape) != shape:
            raise ValueError(f"{checkpoint_dir}: {key!r} has shape {tuple(tensors[key].shape)}, expected {shape}")
    return config, tensors


_HF_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")


def verifier_name(target_model: str, model_dir: str | Path | None = None) -> str:
    """The target as vLLM names it: the folder the drafter was trained and measured against. For
    a GGUF target (the embedded ones too) that is its de-quantized copy, `model_dir`
    (`resolve_target`'s folder), not the model the GGUF was quantized from; else the path or id the
    user gave (a relative path made absolute, as the settings already do)."""
    from .target import is_gguf

    if is_gguf(target_model):
        if model_dir is None:
            raise ValueError(f"{target_model} is a GGUF: name its converted folder (resolve_target), the weights "
                             "the drafter learned")
        return str(Path(model_dir).resolve())
    path = Path(target_model).expanduser()
    return str(path.resolve()) if path.exists() else target_model


def resolvable_by_vllm(name: str) -> bool:
    """vLLM resolves a verifier as an existing path or a Hugging Face id `org/name`."""
    return bool(name) and (Path(name).expanduser().exists() or (_HF_ID.fullmatch(name) is not None and ".." not in name))


def _verifier_architectures(target_model_name_or_path: str) -> list[str]:
    """The target's `architectures` when it is a local folder; [] otherwise (speculators'
    `VerifierConfig.from_pretrained` also falls back to [])."""
    path = Path(target_model_name_or_path) / CONFIG_NAME
    if path.is_file():
        return list(json.loads(path.read_text()).get("architectures") or [])
    return []


def speculators_config(
    config: dict,
    target_model_name_or_path: str,
    speculative_tokens: int = 3,
    verifier_architectures: list[str] | None = None,
) -> dict:
    """config.json of the `speculators` layout for one of our official-layout configs.

    Fields as `Eagle3SpeculatorConfig` (vllm-project/speculators
    `src/speculators/models/eagle3/config.py`) serializes them and as vLLM's adapter
    (`vllm/transformers_utils/configs/speculators/{base,algos}.py`) reads them. Aux ids stay in
    the HF `hidden_states` convention (speculators' `resolve_target_layer_ids` defaults to
    `[2, N//2, N-3]`, the same convention). `norm_before_residual` is written explicitly: vLLM's
    adapter defaults it to True, and our layer takes the residual BEFORE `hidden_norm` (False).
    """
    hf_ids = _hf_ids_of(config)
    if hf_ids is None:
        raise ValueError("checkpoint config has no eagle_aux_hidden_state_layer_ids")
    layer = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": config["vocab_size"],
        "hidden_size": config["hidden_size"],
        "intermediate_size": config["intermediate_size"],
        "num_hidden_layers": 1,
        "num_attention_heads": config["num_attention_heads"],
        "num_key_value_heads": config.get("num_key_value_heads", config["num_attention_heads"]),
        "head_dim": config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        "hidden_act": config.get("hidden_act", "silu"),
        "max_position_embeddings": config["max_position_embeddings"],
        "rms_norm_eps": config["rms_norm_eps"],
        "rope_theta": config.get("rope_theta"),
        "rope_scaling": config.get("rope_scaling"),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": config.get("torch_dtype"),
    }
    if verifier_architectures is None:
        verifier_architectures = _verifier_architectures(target_model_name_or_path)
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": SPECULATORS_MODEL_TYPE,
        "transformer_layer_config": layer,
        "draft_vocab_size": config["draft_vocab_size"],
        "target_hidden_size": config.get("target_hidden_size") or config["hidden_size"],
        "norm_before_residual": False,
        "norm_before_fc": False,
        "embed_requires_grad": False,
        "eagle_aux_hidden_state_layer_ids": hf_ids,
        CONVENTION_KEY: HF_CONVENTION,
        "torch_dtype": config.get("torch_dtype"),
        "speculators_config": {
            "algorithm": SPECULATORS_MODEL_TYPE,
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": int(speculative_tokens),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": target_model_name_or_path,
                "architectures": list(verifier_architectures),
            },
        },
    }


def export_speculators(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    embed_tokens_weight: torch.Tensor,
    target_model_name_or_path: str,
    *,
    speculative_tokens: int = 3,
    verifier_architectures: list[str] | None = None,
) -> Path:
    """Write our checkpoint in the `speculators` layout (`Eagle3Speculator`), which vLLM loads
    through its speculators adapter.

    Weights: `midlayer.*` renamed to `layers.0.*` (as speculators' `Eagle3Converter` does), the
    target's embeddings added as `embed_tokens.weight` (the converter adds the verifier's too),
    `d2t` (int64) and `t2d` (bool) kept; float weights keep the checkpoint's dtype. Files go to
    temporary names first and are renamed into place, weights before config.
    """
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    config, tensors = _read_checkpoint(checkpoint_dir)
    vocab_size, hidden_size = config["vocab_size"], config["hidden_size"]
    if tuple(embed_tokens_weight.shape) != (vocab_size, hidden_size):
        raise ValueError(
            f"embed_tokens_weight has shape {tuple(embed_tokens_weight.shape)}, expected the target's "
            f"[vocab_size={vocab_size}, hidden_size={hidden_size}]"
        )
    dtype = tensors["fc.weight"].dtype
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        if key == "embed_tokens.weight":
            continue  # replaced by the target's own, below
        name = "layers.0." + key.removeprefix("midlayer.") if key.startswith("midlayer.") else key
        out[name] = tensor
    out["d2t"] = out["d2t"].to(torch.int64)
    out["t2d"] = out["t2d"].to(torch.bool)
    if full_vocab(config):
        out = _without_vocab_map(out, checkpoint_dir)
    if not resolvable_by_vllm(target_model_name_or_path):
        raise ValueError(f"verifier {target_model_name_or_path!r} is neither a Hugging Face id (org/name) nor an "
                         "existing path: vLLM could not load the target it names (use verifier_name)")
    out["embed_tokens.weight"] = embed_tokens_weight.detach().to(dtype=dtype, device="cpu")
    out = {k: v.contiguous() for k, v in out.items()}
    new_config = speculators_config(config, target_model_name_or_path, speculative_tokens, verifier_architectures)

    out_dir.mkdir(parents=True, exist_ok=True)
    return write_checkpoint(out_dir, out, new_config)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def _check_ids(
    problems: list[str],
    engine: Engine,
    read_ids: list[int] | None,
    convention: str,
    extracted_layer_ids: list[int] | None,
    target_num_hidden_layers: int | None,
) -> None:
    want = ENGINE_CONVENTION[engine]
    if read_ids is None:
        return
    if convention not in (HF_CONVENTION, SGLANG_CONVENTION):
        problems.append(f"{CONVENTION_KEY} is {convention!r}; expected {HF_CONVENTION!r} or {SGLANG_CONVENTION!r}")
        return
    if convention != want:
        fix = "export with write_engine_checkpoint(..., 'sglang')" if engine == "sglang" else (
            "export with write_engine_checkpoint(..., 'vllm')"
        )
        problems.append(
            f"{engine} reads aux layer ids {read_ids} in the {want!r} convention, but this config declares "
            f"{convention!r} (default: {HF_CONVENTION!r}); the engine would capture the wrong target layers "
            f"and acceptance collapses silently; {fix}"
        )
    hf_read = hf_layer_ids_from_sglang(read_ids) if want == SGLANG_CONVENTION else list(read_ids)
    if extracted_layer_ids is not None and convention == want and hf_read != [int(i) for i in extracted_layer_ids]:
        problems.append(
            f"{engine} would capture HF hidden_states {hf_read} (config ids {read_ids}), but the drafter was "
            f"trained on {list(extracted_layer_ids)}"
        )
    if target_num_hidden_layers is not None:
        bad = [i for i in hf_read if not 0 <= i <= target_num_hidden_layers]
        if bad:
            problems.append(f"aux layer ids {read_ids} reach outside the target's {target_num_hidden_layers} layers")
    if len(read_ids) != 3:
        problems.append(f"{len(read_ids)} aux layer ids; the fc input is 3 * target_hidden_size")


def _check_weights(problems: list[str], weights_path: Path, shapes: dict[str, tuple[int, ...]],
                   ignored: frozenset = frozenset(), full_d2t_problem: str | None = None) -> dict[str, torch.Tensor]:
    if not weights_path.exists():
        problems.append(f"{weights_path.name} missing")
        return {}
    with safe_open(str(weights_path), framework="pt") as f:
        keys = set(f.keys())
        tensors = {k: f.get_tensor(k) for k in keys & {"d2t", "t2d"}}
        for key, shape in shapes.items():
            if key not in keys:
                problems.append(f"weights lack {key!r}")
            elif tuple(f.get_slice(key).get_shape()) != shape:
                problems.append(f"{key!r} has shape {tuple(f.get_slice(key).get_shape())}, expected {shape}")
    extra = sorted(keys - set(shapes) - {"embed_tokens.weight"} - ignored)
    if extra:
        # Neither engine serves them as trained: vLLM's fc has no bias and its loader raises on a
        # name it has no parameter for (or, where it skips it, drops it); SGLang skips names it
        # does not have (fc.bias too, unless the config says bias: true). See the module doc.
        problems.append(f"unexpected weights {extra}: the engines would fail on them or serve the drafter "
                        "without them (vLLM raises or drops them; SGLang skips them silently)")
    if "d2t" in keys and full_d2t_problem:
        problems.append(full_d2t_problem)
    if "d2t" in tensors and "t2d" in tensors:
        d2t, t2d = tensors["d2t"].to(torch.int64), tensors["t2d"].to(torch.bool)
        target_ids = torch.arange(d2t.numel()) + d2t
        if int(t2d.sum()) != d2t.numel() or not torch.equal(target_ids, torch.nonzero(t2d).flatten()):
            problems.append("d2t and t2d disagree: arange + d2t must be exactly the ids where t2d is True")
    return tensors


def _vocab_map_rules(config: dict, engine: Engine, shapes: dict) -> tuple[dict, dict]:
    """Expected shapes and `_check_weights` options: a full-vocabulary drafter served by vLLM
    must come without d2t (module doc); t2d is skipped by name, harmless."""
    if engine != "vllm" or not full_vocab(config):
        return shapes, {}
    shapes = {k: v for k, v in shapes.items() if k not in ("d2t", "t2d")}
    return shapes, {"ignored": frozenset({"t2d"}), "full_d2t_problem": (
        "d2t in the weights of a full-vocabulary drafter (draft_vocab_size == vocab_size): vLLM builds no "
        "draft_id_to_target_id then and fails to load it; export with write_engine_checkpoint(..., 'vllm') "
        "or export_speculators, which leave it out")}


def _validate_official(
    config: dict, checkpoint_dir: Path, engine: Engine, extracted_layer_ids, target_num_hidden_layers
) -> list[str]:
    problems: list[str] = []
    if CHECKPOINT_ARCHITECTURE not in (config.get("architectures") or []):
        problems.append(f"architectures is {config.get('architectures')}, expected [{CHECKPOINT_ARCHITECTURE!r}]")
    if config.get("num_hidden_layers") != 1:
        problems.append(f"num_hidden_layers is {config.get('num_hidden_layers')}, our weights hold one midlayer")
    if config.get("draft_vocab_size") is None:
        problems.append(
            "draft_vocab_size missing: vLLM then builds lm_head over vocab_size and SGLang loads the target's "
            "lm_head instead of ours"
        )
    if config.get("target_hidden_size") is None:
        problems.append("target_hidden_size missing: both engines then size fc as 3 * hidden_size")
    if config.get("tie_word_embeddings"):
        problems.append("tie_word_embeddings is true: SGLang then uses the embeddings as lm_head")
    if config.get("norm_before_residual"):
        problems.append("norm_before_residual is true: our layer takes the residual before hidden_norm")
    eagle = config.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state") is False:
        problems.append("eagle_config.use_aux_hidden_state is false: the engines then drop fc")
    top, nested = config.get("eagle_aux_hidden_state_layer_ids"), eagle.get("eagle_aux_hidden_state_layer_ids")
    if engine == "vllm":
        if top is None and nested is None:
            problems.append("no eagle_aux_hidden_state_layer_ids: vLLM uses the target's default layers")
        elif top is None:
            problems.append(
                "eagle_aux_hidden_state_layer_ids only under eagle_config: vLLM builds whose "
                "get_eagle3_aux_layers_from_config reads only the top level fall back to the target's default "
                "layers; export with write_engine_checkpoint(..., 'vllm')"
            )
        elif nested is not None and list(nested) != list(top):
            problems.append(f"top-level aux ids {top} differ from eagle_config's {nested}")
        read = top if top is not None else nested
    else:
        if nested is None:
            problems.append(
                "no eagle_config.eagle_aux_hidden_state_layer_ids: SGLang reads only that field and otherwise "
                "captures the target's default layers"
            )
        read = nested
    convention = config.get(CONVENTION_KEY, HF_CONVENTION)
    _check_ids(problems, engine, None if read is None else list(read), convention, extracted_layer_ids,
               target_num_hidden_layers)
    if config.get("draft_vocab_size") is None:
        return problems  # weight shapes depend on it
    try:
        shapes = expected_shapes(config_from_checkpoint(config))
    except (ValueError, TypeError) as e:
        problems.append(f"config unreadable: {e}")
        return problems
    shapes, options = _vocab_map_rules(config, engine, shapes)
    _check_weights(problems, checkpoint_dir / WEIGHTS_NAME, shapes, **options)
    return problems


def _validate_speculators(
    config: dict, checkpoint_dir: Path, engine: Engine, extracted_layer_ids, target_num_hidden_layers
) -> list[str]:
    if engine == "sglang":
        return ["SGLang loads the official EAGLE-3 layout (LlamaForCausalLMEagle3), not the speculators layout"]
    problems: list[str] = []
    # vllm/transformers_utils/configs/speculators/base.py validate_speculators_config
    try:
        spec = config["speculators_config"]
        _ = spec["proposal_methods"][0]["speculative_tokens"]
        _ = spec["verifier"]["name_or_path"]
        if not isinstance(spec["verifier"]["name_or_path"], str) or not resolvable_by_vllm(spec["verifier"]["name_or_path"]):
            problems.append(
                f"speculators_config.verifier.name_or_path is {spec['verifier']['name_or_path']!r}: vLLM resolves only a "
                "Hugging Face id (org/name) or an existing path; write the target's id or path (verifier_name)")
    except (KeyError, IndexError, TypeError):
        problems.append("speculators_config lacks proposal_methods[0].speculative_tokens or verifier.name_or_path")
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        problems.append("transformer_layer_config missing or not a dict")
        layer = {}
    if config.get("draft_vocab_size") is None:
        problems.append("draft_vocab_size missing: vLLM then builds lm_head over the full vocab_size")
    if "norm_before_residual" not in config:
        problems.append("norm_before_residual missing: vLLM's speculators adapter defaults it to true")
    elif config["norm_before_residual"]:
        problems.append("norm_before_residual is true: our layer takes the residual before hidden_norm")
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        problems.append("eagle_aux_hidden_state_layer_ids missing: vLLM uses the target's default layers")
    _check_ids(problems, engine, None if ids is None else list(ids), config.get(CONVENTION_KEY, HF_CONVENTION),
               extracted_layer_ids, target_num_hidden_layers)
    if config.get("draft_vocab_size") is None:
        return problems  # weight shapes depend on it
    flat = {**layer, "draft_vocab_size": config.get("draft_vocab_size"),
            "target_hidden_size": config.get("target_hidden_size")}
    try:
        shapes = expected_shapes(config_from_checkpoint(flat))
    except (ValueError, TypeError) as e:
        problems.append(f"transformer_layer_config unreadable: {e}")
        return problems
    shapes = {("layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v for k, v in shapes.items()}
    shapes["embed_tokens.weight"] = (flat["vocab_size"], flat["hidden_size"])
    shapes, options = _vocab_map_rules(flat, engine, shapes)
    _check_weights(problems, checkpoint_dir / WEIGHTS_NAME, shapes, **options)
    return problems


def validate_for_engine(
    checkpoint_dir: str | Path,
    engine: Engine,
    *,
    extracted_layer_ids: list[int] | None = None,
    target_num_hidden_layers: int | None = None,
) -> list[str]:
    """The problems `engine` ("vllm" or "sglang") would have with this drafter directory, as
    sentences; [] when none were found. Reads the official layout and the speculators layout.

    Checks what the engines' loaders read (see the module docstring): architecture, one layer,
    `draft_vocab_size`, `target_hidden_size`, tied embeddings, `norm_before_residual`, where the
    aux layer ids are and in which convention (`CONVENTION_KEY`, default HF), every weight and
    its shape, unexpected weights, d2t/t2d agreement. `extracted_layer_ids` (the HF indices the
    hidden states were extracted at, from the shard metadata) and `target_num_hidden_layers`
    add checks that the ids the engine reads capture exactly those layers.
    """
    if engine not in ENGINE_CONVENTION:
        raise ValueError(f"engine must be 'vllm' or 'sglang'; got {engine!r}")
    checkpoint_dir = Path(checkpoint_dir)
    config_path = checkpoint_dir / CONFIG_NAME
    if not config_path.exists():
        return [f"{CONFIG_NAME} missing in {checkpoint_dir}"]
    config = json.loads(config_path.read_text())
    if config.get("speculators_model_type") is not None:
        return _validate_speculators(config, checkpoint_dir, engine, extracted_layer_ids, target_num_hidden_layers)
    return _validate_official(config, checkpoint_dir, engine, extracted_layer_ids, target_num_hidden_layers)


def shard_aux_layer_ids(shard_dir: Path) -> list[int]:
    """The layer ids a shard of hidden states was extracted with, from a sample file's metadata."""
    first = next(shard_dir.glob("*.safetensors"))
    with safe_open(str(first), framework="pt") as f:
        return [int(x) for x in f.metadata()["aux_layer_ids"].split(",")]


def model_architectures(model_dir: Path) -> list[str]:
    return list(json.loads((model_dir / "config.json").read_text()).get("architectures") or [])


def export_for_engines(
    checkpoint_dir: Path, out_dirs: dict[str, Path], model_dir: Path, target_model: str, speculative_tokens: int,
    aux_layer_ids: list[int],
) -> dict[str, Path]:
    """The trained drafter, one copy per serving engine (`out_dirs`: vllm, sglang, speculators),
    each validated as its engine would load it; a copy that would not load raises ValueError.

    Each engine reads the layer ids from a different place and in a different numbering (README,
    "Layer ids"); the validator checks them against `aux_layer_ids`, those the shards were
    extracted at."""
    exports = {e: write_engine_checkpoint(checkpoint_dir, out_dirs[e], e) for e in ("vllm", "sglang")}
    embed, _, _ = load_target_head(model_dir)
    # The verifier is what the drafter learned: a GGUF target's (the embedded one's) converted
    # folder, a user's folder by the path they gave; the architectures come from that folder.
    exports["speculators"] = export_speculators(
        checkpoint_dir, out_dirs["speculators"], embed, verifier_name(target_model, model_dir),
        speculative_tokens=speculative_tokens,
        verifier_architectures=model_architectures(model_dir),
    )
    for engine, path in (("vllm", exports["vllm"]), ("sglang", exports["sglang"]), ("vllm", exports["speculators"])):
        problems = validate_for_engine(path, engine, extracted_layer_ids=aux_layer_ids)
        if problems:
            raise ValueError(f"drafter export {path} would not load correctly in {engine}: {problems}")
    return exports
