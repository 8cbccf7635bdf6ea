"""One settings model for every knob of the pipeline.

Load it with `load_settings(path)`; with no path it is the embedded demo
(`eagle3_assets/defaults/demo.yaml`): the real SmolLM2-135M-Instruct and a few
hundred ShareGPT prompts, small enough for a laptop CPU. The class defaults are
the production ones (2,000-row shards, full-length samples).

Each stage's section is that stage's own config dataclass from `core/` (one name and
one default per knob, defined once): `generation` is `GenerationConfig`, `extraction`
`ExtractConfig`, `vocab` `VocabConfig`, `training` `TrainConfig`, `eval` `EvalConfig`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .core.evaluate import EvalConfig
from .core.extract_job import ExtractConfig
from .core.generate import GenerationConfig
from .core.prompts import EMBEDDED_PROMPTS, PromptSource
from .core.self_prompts import SelfPromptsConfig
from .core.target import EMBEDDED_MODEL, EMBEDDED_MODELS, EMBEDDED_PREFIX
from .core.train import TrainConfig
from .core.vocab import VocabConfig
from .launchers import LauncherSettings

DEMO_SETTINGS = Path(__file__).parent / "defaults" / "demo.yaml"
GPU_SETTINGS = Path(__file__).parent / "defaults" / "gpu.yaml"
__all__ = ["EMBEDDED_MODEL", "EMBEDDED_PROMPTS", "Settings", "SettingsError", "load_settings"]


class Settings(BaseModel):
    # A typo in a settings key must fail loudly, not fall back to a default.
    model_config = ConfigDict(extra="forbid", frozen=True)

    target_model: str = EMBEDDED_MODEL  # a Hugging Face folder, a .gguf file, or the embedded model
    # JSONL / JSON / Parquet, an embedded set (embedded:sharegpt, embedded:chitchat), a generator
    # (generator:reasoning-gym/<name>; generator:self, requests the target writes), or a list of them, each a string or a PromptSource
    # ({source, max_prompts | weight, licence, seed}), read in order (README, "Prompt sources").
    prompts_source: str | list[str | PromptSource] = EMBEDDED_PROMPTS
    max_prompts: int | None = Field(None, ge=1)  # keep the first N usable prompts (of all sources)
    # Drop prompts that share word 13-grams (8-grams when short) with MT-bench (every turn) or
    # an eval.prompt_sets file, counted as dropped_contaminated (core/decontaminate.py).
    decontaminate: bool = True
    max_prompt_tokens: int = Field(1024, ge=1)  # longer templated prompts are dropped and counted
    shard_size: int = Field(2000, ge=1)
    storage_root: str = ".eagle3/data"
    model_cache_dir: str | None = None  # where a GGUF target is converted once; default ~/.cache
    generation: GenerationConfig = GenerationConfig()
    # how the target writes the generator:self source's requests (core/self_prompts.py)
    self_prompts: SelfPromptsConfig = SelfPromptsConfig()
    extraction: ExtractConfig = ExtractConfig()
    vocab: VocabConfig = VocabConfig()
    training: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    launcher: LauncherSettings = LauncherSettings()  # where GPU jobs run: this machine (default) or Kubernetes

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
    if isinstance(obj, BaseModel):
        return obj.model_dump()
    return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj


class SettingsError(ValueError):
    pass


def _message(err: dict) -> str:
    """pydantic's message, except for a key that is not a setting: name the keys that are."""
    if err["type"] not in ("extra_forbidden", "unexpected_keyword_argument"):
        return err["msg"]
    section: type = Settings
    for part in err["loc"][:-1]:
        hint = section.model_fields[part].annotation if issubclass(section, BaseModel) else None
        section = hint if isinstance(hint, type) else section
    keys = section.model_fields if issubclass(section, BaseModel) else [f.name for f in dataclasses.fields(section)]
    return f"unknown key (the keys here are: {', '.join(keys)})"


PRESET_PREFIX = "preset:"


def load_settings(path: str | os.PathLike | None = None, _chain: tuple[Path, ...] = ()) -> Settings:
    """Settings from a YAML file; None loads the embedded demo. A file may start from another
    (`extends: base.yaml`, relative to the file, or `extends: preset:gpu`): the base's settings,
    with this file's keys over them (a section merges key by key; a list or value replaces)."""
    path = Path(path) if path else DEMO_SETTINGS
    if not path.is_file():
        raise SettingsError(f"settings file {path} does not exist"
                            + (f" (named by extends: in {_chain[-1]})" if _chain else ""))
    raw = _read_mapping(path)
    if "extends" in raw:
        base_path = _base_path(raw.pop("extends"), path)
        chain = (*_chain, path.resolve())
        if base_path.resolve() in chain:
            raise SettingsError(f"settings file {path}: extends: makes a loop "
                                f"({' -> '.join(str(p) for p in (*chain, base_path.resolve()))})")
        # The base loads as a whole, its relative paths placed against its own folder, so they
        # stay right in a file elsewhere; what is left relative comes from this file.
        raw = _merged(load_settings(base_path, chain).model_dump(mode="json"), raw)
    try:
        settings = Settings(**raw)
    except ValidationError as e:
        lines = [f"  {'.'.join(map(str, err['loc']))}: {_message(err)}" for err in e.errors()]
        raise SettingsError(f"settings file {path} is invalid:\n" + "\n".join(lines)) from None
    # Relative paths are relative to the settings file, so a run does not depend on the current
    # folder. A packaged preset's are relative to the project (the current folder: `eagle3` runs
    # from the project root), never to the package, which may sit in site-packages.
    settings = _paths_relative_to(settings, Path.cwd() if is_preset(path) else path.parent)
    _check_target(settings, path)
    return settings


def _read_mapping(path: Path) -> dict:
    try:
        raw = yaml.safe_load(path.read_bytes().decode("utf-8")) or {}
    except UnicodeDecodeError as e:
        line = e.object[:e.start].count(b"\n") + 1
        raise SettingsError(f"settings file {path} is not UTF-8 text (line {line}, byte {e.start}: {e.reason})") from None
    except yaml.YAMLError as e:
        raise SettingsError(f"settings file {path} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise SettingsError(f"settings file {path} must hold a mapping, got {type(raw).__name__}")
    return raw


def _base_path(value, path: Path) -> Path:
    """The file that `extends:` names: a path relative to the naming file, or a packaged preset."""
    presets = sorted(p.stem for p in DEMO_SETTINGS.parent.glob("*.yaml"))
    if not isinstance(value, str) or not value:
        raise SettingsError(f"settings file {path}: extends: must name a settings file "
                            f"(a path, or one of {', '.join(PRESET_PREFIX + n for n in presets)}), got {value!r}")
    if value.startswith(PRESET_PREFIX):
        name = value[len(PRESET_PREFIX):]
        if name not in presets:
            raise SettingsError(f"settings file {path}: extends: {value} is not a preset "
                                f"(presets: {', '.join(PRESET_PREFIX + n for n in presets)})")
        return DEMO_SETTINGS.parent / f"{name}.yaml"
    return path.parent / Path(value).expanduser()


def _merged(base: dict, over: dict) -> dict:
    """`over`'s keys over `base`'s; where both hold a mapping, merged the same way."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def is_preset(path: Path) -> bool:
    """One of the packaged settings files (`eagle3_assets/defaults/*.yaml`), from this install or
    from a source checkout beside it."""
    folder = path.resolve().parent
    return folder == DEMO_SETTINGS.resolve().parent or (folder.name == "defaults" and folder.parent.name == "eagle3_assets"
                                                        and (folder / DEMO_SETTINGS.name).is_file())


def _check_target(settings: Settings, path: Path) -> None:
    """A target that cannot be found is a settings error, before any step runs (the GGUF
    conversion and the folder's own checks wait for the first stage that loads it)."""
    target = settings.target_model
    if target.startswith(EMBEDDED_PREFIX):
        if target[len(EMBEDDED_PREFIX):] not in EMBEDDED_MODELS:
            raise SettingsError(f"settings file {path}: target_model {target!r} is not an embedded model "
                                f"(embedded: {', '.join(EMBEDDED_PREFIX + n for n in EMBEDDED_MODELS)})")
    elif not Path(target).expanduser().exists():
        raise SettingsError(f"settings file {path}: target_model {target} does not exist "
                            "(a Hugging Face model folder or a .gguf file)")


def _paths_relative_to(settings: Settings, folder: Path) -> Settings:
    def place(value: str | None) -> str | None:
        if value is None or value.startswith(("embedded:", "generator:")) or Path(value).expanduser().is_absolute():
            return value
        return str((folder / value).resolve())

    return settings.model_copy(update={
        "storage_root": place(settings.storage_root),
        "target_model": place(settings.target_model),
        "prompts_source": (place(settings.prompts_source) if isinstance(settings.prompts_source, str) else [
            place(e) if isinstance(e, str) else dataclasses.replace(e, source=place(e.source))
            for e in settings.prompts_source]),
        "model_cache_dir": place(settings.model_cache_dir),
        "eval": dataclasses.replace(settings.eval, prompt_sets=[place(p) for p in settings.eval.prompt_sets]),
    })


def settings_path_from_env() -> str | None:
    """The settings file the Dagster code location uses: $EAGLE3_SETTINGS, else ./eagle3.yaml if present."""
    env = os.environ.get("EAGLE3_SETTINGS")
    if env:
        return env
    return "eagle3.yaml" if Path("eagle3.yaml").is_file() else None
