"""One settings model for every knob of the pipeline.

Load it with `load_settings(path)`; with no path it is the embedded demo
(`eagle3_assets/defaults/demo.yaml`): the real SmolLM2-135M-Instruct and a few
hundred ShareGPT prompts, small enough for a laptop CPU. The class defaults are
the production ones (2,000-row shards, full-length samples).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .launcher_settings import LauncherSettings

DEMO_SETTINGS = Path(__file__).parent / "defaults" / "demo.yaml"
EMBEDDED_MODEL = "embedded:SmolLM2-135M-Instruct"
EMBEDDED_PROMPTS = "embedded:sharegpt"


class _Strict(BaseModel):
    # A typo in a settings key must fail loudly, not fall back to a default.
    model_config = ConfigDict(extra="forbid", frozen=True)


class GenerationSettings(_Strict):
    engine: Literal["transformers", "vllm"] = "transformers"
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    device: str = "auto"
    batch_size: int = Field(32, ge=1)
    max_new_tokens: int = Field(512, ge=1)
    do_sample: bool = False
    temperature: float = Field(0.7, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int = 0
    tensor_parallel_size: int = Field(1, ge=1)  # vLLM only


class ExtractionSettings(_Strict):
    # Hugging Face `hidden_states` convention: 0 = embeddings, j = output of layer j-1.
    # None means the EAGLE-3 default [2, N//2, N-3] for an N-layer target.
    aux_layer_ids: list[int] | None = None
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    device: str = "auto"  # "auto" = cuda when available, else cpu
    batch_tokens: int = Field(16384, ge=1)  # tokens per forward (padded)
    writer_threads: int = Field(4, ge=1)
    nproc: int = Field(1, ge=1)  # >1 launches torchrun
    parallel: Literal["data", "tensor"] = "data"


class VocabSettings(_Strict):
    draft_vocab_size: int = Field(32000, ge=1)


class TrainingSettings(_Strict):
    ttt_steps: int = Field(7, ge=1)
    loss_decay: float = Field(0.8, gt=0, le=1)
    lr: float = Field(1e-4, gt=0)
    warmup_steps: int = Field(100, ge=0)
    epochs: float = Field(1.0, gt=0)
    batch_tokens: int = Field(8192, ge=1)
    grad_clip: float = Field(0.5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    seed: int = 0
    device: str = "auto"
    nproc: int = Field(1, ge=1)  # >1 launches torchrun: DDP over that many processes
    save_every: int = Field(50, ge=1)  # steps between saved training states (resume after a kill)


class EvalSettings(_Strict):
    num_prompts: int = Field(80, ge=1)  # MT-bench first turns
    max_new_tokens: int = Field(256, ge=1)
    num_draft_tokens: int = Field(7, ge=1)
    device: str = "auto"


class Settings(_Strict):
    target_model: str = EMBEDDED_MODEL  # a Hugging Face folder, a .gguf file, or the embedded model
    prompts_source: str = EMBEDDED_PROMPTS  # JSONL / JSON / Parquet, or the embedded ShareGPT set
    max_prompts: int | None = Field(None, ge=1)  # keep the first N usable prompts
    max_prompt_tokens: int = Field(1024, ge=1)  # longer templated prompts are dropped and counted
    shard_size: int = Field(2000, ge=1)
    storage_root: str = ".eagle3/data"
    model_cache_dir: str | None = None  # where a GGUF target is converted once; default ~/.cache
    generation: GenerationSettings = GenerationSettings()
    extraction: ExtractionSettings = ExtractionSettings()
    vocab: VocabSettings = VocabSettings()
    training: TrainingSettings = TrainingSettings()
    eval: EvalSettings = EvalSettings()
    launcher: LauncherSettings = LauncherSettings()  # where GPU jobs run: local (default) or Kubernetes

    @model_validator(mode="after")
    def _check(self) -> "Settings":
        ids = self.extraction.aux_layer_ids
        if ids is not None and (len(ids) != 3 or len(set(ids)) != 3):
            raise ValueError(f"extraction.aux_layer_ids must be three distinct layer ids, got {ids}")
        return self

    @property
    def root(self) -> Path:
        return Path(self.storage_root).expanduser().resolve()

    def fingerprint(self, *fields: str) -> str:
        """Short hash of the named settings (dotted paths), for code and data versions."""
        values = {f: _get(self, f) for f in fields}
        blob = json.dumps(values, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def _get(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj.model_dump() if isinstance(obj, BaseModel) else obj


class SettingsError(ValueError):
    pass


def load_settings(path: str | os.PathLike | None = None) -> Settings:
    """Settings from a YAML file; None loads the embedded demo."""
    path = Path(path) if path else DEMO_SETTINGS
    if not path.is_file():
        raise SettingsError(f"settings file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise SettingsError(f"settings file {path} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise SettingsError(f"settings file {path} must hold a mapping, got {type(raw).__name__}")
    try:
        settings = Settings(**raw)
    except ValidationError as e:
        lines = [f"  {'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]
        raise SettingsError(f"settings file {path} is invalid:\n" + "\n".join(lines)) from None
    # Relative storage paths are relative to the settings file, so a run does not depend on cwd.
    if not Path(settings.storage_root).expanduser().is_absolute() and path != DEMO_SETTINGS:
        settings = settings.model_copy(update={"storage_root": str((path.parent / settings.storage_root).resolve())})
    return settings


def settings_path_from_env() -> str | None:
    """The settings file the Dagster code location uses: $EAGLE3_SETTINGS, else ./eagle3.yaml if present."""
    env = os.environ.get("EAGLE3_SETTINGS")
    if env:
        return env
    return "eagle3.yaml" if Path("eagle3.yaml").is_file() else None
