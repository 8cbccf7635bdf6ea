"""Prompt generators: sources that make their prompts instead of reading them from a file.

A generator is named in `prompts_source` as `generator:<kind>/<name>` and yields conversations
(index, system, human turns) without end, the same ones for the same seed; the prompt mixture
(`core/prompts.py`) takes as many as the entry's cap or weight asks for. One kind is here:

- `reasoning-gym/<dataset>`: one of reasoning-gym's procedural data sets (Apache-2.0; e.g.
  `basic_arithmetic`, `word_sorting`, `propositional_logic`), asked in chunks of `CHUNK`
  questions, chunk k seeded with seed + k, so the first N prompts do not depend on N.

A new kind is one entry in `_KINDS`: a function (name, seed) -> conversations, a licence, and
the version that goes into the prompts' data version.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from typing import Callable, Iterator

CHUNK = 1000
PREFIX = "generator:"


class GeneratorError(ValueError):
    pass


@dataclass(frozen=True)
class _Kind:
    conversations: Callable[[str, int], Iterator[tuple[int, str | None, list[str]]]]
    licence: str
    package: str  # its version goes into the data version: a new release may make other prompts


def _reasoning_gym(name: str, seed: int) -> Iterator[tuple[int, str | None, list[str]]]:
    try:
        import reasoning_gym
    except ImportError as e:
        raise GeneratorError(
            f"generator:reasoning-gym/{name} needs the reasoning-gym package (scripts/setup.sh installs it): {e}"
        ) from None
    names = sorted(reasoning_gym.factory.DATASETS)
    if name not in names:
        raise GeneratorError(f"reasoning-gym has no data set {name!r}; it has: {', '.join(names)}")
    index, chunk = 0, 0
    while True:
        for item in reasoning_gym.create_dataset(name, size=CHUNK, seed=seed + chunk):
            yield index, None, [item["question"]]
            index += 1
        chunk += 1


_KINDS = {"reasoning-gym": _Kind(_reasoning_gym, "Apache-2.0 (reasoning-gym)", "reasoning-gym")}


def _parse(source: str) -> tuple[_Kind, str]:
    kind, _, name = source.removeprefix(PREFIX).partition("/")
    if kind not in _KINDS or not name:
        raise GeneratorError(f"{source}: expected generator:<kind>/<name> with kind one of {sorted(_KINDS)}")
    return _KINDS[kind], name


def generate_conversations(source: str, seed: int) -> Iterator[tuple[int, str | None, list[str]]]:
    kind, name = _parse(source)
    return kind.conversations(name, seed)


def generator_licence(source: str) -> str:
    return _parse(source)[0].licence


def generator_fingerprint(source: str, seed: int) -> str:
    kind, _ = _parse(source)
    try:
        version = importlib.metadata.version(kind.package)
    except importlib.metadata.PackageNotFoundError:
        version = "not installed"
    return f"{source}:{version}:{seed}"
