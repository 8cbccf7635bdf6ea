"""The EAGLE-3 draft vocabulary: the most frequent answer tokens of the target.

The drafter's head predicts over `draft_vocab_size` tokens only. Two maps tie that small
vocabulary to the target's (same layout as the official SafeAILab/EAGLE `traineagle3` code,
which SGLang and vLLM load):

- `d2t` (int64, [draft_vocab_size]): `target_id = draft_id + d2t[draft_id]`;
- `t2d` (bool, [vocab_size]): True where a target token is in the draft vocabulary.

The draft ids are the chosen target ids sorted ascending, so `d2t` is a non-decreasing offset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import STRICT, Fraction, PositiveInt
from .files import atomic_path


@dataclass(frozen=True)
class VocabConfig:
    """The `vocab:` section of the settings."""

    __pydantic_config__ = STRICT
    # The draft vocabulary's size; with `coverage` set, its upper bound.
    draft_vocab_size: PositiveInt = 32000
    # When set: the smallest size (a multiple of 256) whose tokens cover this share of the
    # loss-masked answer tokens, at most draft_vocab_size.
    coverage: Fraction | None = None


def choose_draft_vocab_size(counts: torch.Tensor, cfg: VocabConfig) -> int:
    """`draft_vocab_size`, or with `coverage` the smallest multiple of 256 that reaches it."""
    if cfg.coverage is None:
        return cfg.draft_vocab_size
    total = int(counts.sum())
    if total == 0:
        raise ValueError("vocab.coverage: no loss-masked tokens were counted (all counts are zero)")
    cumulative = torch.sort(counts.reshape(-1), descending=True).values.cumsum(0)
    needed = int(torch.searchsorted(cumulative, math.ceil(cfg.coverage * total))) + 1
    return min(cfg.draft_vocab_size, counts.numel(), 256 * math.ceil(needed / 256))


def count_tokens(samples: Iterable[tuple[Sequence[int], Sequence[int]]], vocab_size: int) -> torch.Tensor:
    """Count, per target token id, how often it appears where `loss_mask == 1`.

    `samples` yields `(input_ids, loss_mask)` pairs (lists, arrays or tensors of equal length).
    Returns int64 counts of shape [vocab_size].
    """
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for index, (input_ids, loss_mask) in enumerate(samples):
        ids = torch.as_tensor(input_ids, dtype=torch.int64).reshape(-1)
        mask = torch.as_tensor(loss_mask).reshape(-1)
        if ids.shape != mask.shape:
            raise ValueError(
                f"sample {index}: input_ids has {ids.numel()} tokens but loss_mask has {mask.numel()}"
            )
        answer_ids = ids[mask == 1]
        if answer_ids.numel() == 0:
            continue
        if answer_ids.min() < 0 or answer_ids.max() >= vocab_size:
            raise ValueError(
                f"sample {index}: token id {int(answer_ids.max())} is outside the target vocabulary "
                f"of {vocab_size}; is vocab_size the target's?"
            )
        counts += torch.bincount(answer_ids, minlength=vocab_size)
    return counts


def build_vocab_map(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the `draft_vocab_size` most frequent tokens and build `(d2t, t2d)`.

    Ties are broken by the lower token id. When fewer than `draft_vocab_size` tokens were seen,
    the lowest unused ids fill the rest (a stable sort puts the zero counts last, in id order).
    """
    vocab_size = counts.numel()
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(
            f"draft_vocab_size must be between 1 and the target vocab_size ({vocab_size}); "
            f"got {draft_vocab_size}"
        )
    # Descending by count; `stable=True` keeps equal counts in ascending id order.
    order = torch.sort(counts.reshape(-1), descending=True, stable=True).indices
    used = torch.sort(order[:draft_vocab_size]).values
    d2t = used - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t.to(torch.int64), t2d


def coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    """Share of the counted (loss-masked) tokens whose id is in the draft vocabulary."""
    total = int(counts.sum())
    if total == 0:
        raise ValueError("coverage: no loss-masked tokens were counted (all counts are zero)")
    return int(counts[t2d.to(torch.bool)].sum()) / total


def save_vocab_map(path: str | Path, d2t: torch.Tensor, t2d: torch.Tensor, metadata: dict[str, str]) -> None:
    """Write `d2t` and `t2d` (bool) to a safetensors file, atomically (temp name, then rename)."""
    tensors = {
        "d2t": d2t.to(torch.int64).contiguous(),
        "t2d": t2d.to(torch.bool).contiguous(),
    }
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={str(k): str(v) for k, v in metadata.items()})


def vocab_map_fingerprint(d2t: torch.Tensor) -> str:
    """Names a draft vocabulary by its content: top-k sample files record it, so files over another
    vocabulary are redone rather than trained on."""
    import hashlib

    return f"{d2t.numel()}-" + hashlib.sha256(d2t.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()[:12]


def load_vocab_map(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Read `(d2t, t2d)` back and check that they describe the same draft vocabulary."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"vocab map not found: {path}")
    with safe_open(str(path), framework="pt") as f:
        missing = {"d2t", "t2d"} - set(f.keys())
        if missing:
            raise ValueError(f"{path}: missing key(s) {sorted(missing)}; expected 'd2t' and 't2d'")
        d2t = f.get_tensor("d2t").to(torch.int64)
        t2d = f.get_tensor("t2d").to(torch.bool)
    target_ids = torch.arange(d2t.numel()) + d2t
    if int(t2d.sum()) != d2t.numel() or not torch.equal(target_ids, torch.nonzero(t2d).flatten()):
        raise ValueError(f"{path}: d2t and t2d disagree (i + d2t[i] must be exactly the ids where t2d is True)")
    return d2t, t2d
