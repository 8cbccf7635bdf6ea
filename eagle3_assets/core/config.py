"""Helpers for the stage configs: plain dataclasses that the settings file fills in.

Each stage's config is a frozen dataclass in that stage's core module (`GenerationConfig`,
`ExtractConfig`, `VocabConfig`, `TrainConfig`, `EvalConfig`), with one name and one
default per knob. The settings model (`eagle3_assets/settings.py`) uses them as its
sections, so pydantic validates a settings file against them (unknown keys refused,
through `STRICT`), and core never imports the settings module.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Annotated, Any, TypeVar

from annotated_types import Ge, Gt, Le

# Read by pydantic when it validates a stdlib dataclass: a typo in a settings key fails loudly.
STRICT = {"extra": "forbid"}

# Field constraints, checked by pydantic for every field of a settings file at once.
PositiveInt = Annotated[int, Ge(1)]
NonNegativeInt = Annotated[int, Ge(0)]
PositiveFloat = Annotated[float, Gt(0)]
NonNegativeFloat = Annotated[float, Ge(0)]
Fraction = Annotated[float, Gt(0), Le(1)]  # in (0, 1]

T = TypeVar("T")


def require(ok: bool, message: str) -> None:
    """A check across fields, in `__post_init__`: pydantic reports it under the section."""
    if not ok:
        raise ValueError(message)


def to_json(obj) -> str:
    return json.dumps(dataclasses.asdict(obj))


def from_dict(cls: type[T], data: dict[str, Any]) -> T:
    """Rebuild a (nested) config dataclass from `dataclasses.asdict` output, e.g. after JSON."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        value, hint = data[f.name], hints[f.name]
        kwargs[f.name] = _field_value(hint, value)
    return cls(**kwargs)


def _field_value(hint, value):
    """A field's value from JSON: a nested config dataclass, or a list of them, rebuilt."""
    if dataclasses.is_dataclass(hint) and isinstance(value, dict):
        return from_dict(hint, value)
    args = typing.get_args(hint)
    if (typing.get_origin(hint) is list and len(args) == 1 and dataclasses.is_dataclass(args[0])
            and isinstance(value, list)):
        return [from_dict(args[0], v) if isinstance(v, dict) else v for v in value]
    return value


def from_json(cls: type[T], text: str) -> T:
    return from_dict(cls, json.loads(text))
