"""The hidden-state file contract: one safetensors file per sample, a manifest written last.

Per sample, `<shard_dir>/<row_id:07d>.safetensors` holds `input_ids` int32 [T],
`loss_mask` uint8 [T], `aux_hidden_states` [T, 3H] (the three aux layers,
concatenated) and `last_hidden_state` [T, H] (after the final norm, so target
logits = lm_head(last_hidden_state)); the safetensors metadata names the target,
the layer ids, the dtype and the format version. Files are written under a
temporary name and renamed: a file that exists is complete. `manifest.parquet`
(row_id, file, tokens, bytes) is written last and marks the shard complete.

Every reader and checker of those files goes through this module: the extraction
engine writes with `write_sample`, resume keeps what `validate_sample` accepts,
training reads with `list_samples`/`read_sample`, and the checks predict bytes with
`bytes_per_token`.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from .files import atomic_path, atomic_write_parquet, remove_temporaries

if TYPE_CHECKING:  # polars is imported where it is used: the engine's writers do not need it
    import polars as pl

FORMAT_VERSION = "1"
MANIFEST = "manifest.parquet"
KEYS = ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state")
DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
_ST_NAMES = {**DTYPE_NAMES, torch.int32: "I32", torch.uint8: "U8"}


class DiskSpaceError(OSError):
    pass


def sample_file(shard_dir: Path, row_id: int) -> Path:
    return shard_dir / f"{row_id:07d}.safetensors"


def bytes_per_token(hidden_size: int, dtype: torch.dtype) -> int:
    """Tensor bytes one token costs in a sample file (headers not included)."""
    item = torch.empty((), dtype=dtype).element_size()
    return 4 + 1 + 4 * hidden_size * item  # input_ids + loss_mask + 3H aux + H last


def write_sample(
    path: Path, input_ids, loss_mask, aux: torch.Tensor, last: torch.Tensor, metadata: dict[str, str], fsync: bool = False
) -> int:
    tensors = {
        "input_ids": torch.as_tensor(input_ids, dtype=torch.int32),
        "loss_mask": torch.as_tensor(loss_mask, dtype=torch.uint8),
        "aux_hidden_states": aux,
        "last_hidden_state": last,
    }
    return write_safetensors(path, tensors, metadata, fsync)


def write_safetensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None, fsync: bool = False
) -> int:
    """Write a safetensors file (temporary name, then atomic rename); returns its size.

    The same bytes layout as `safetensors.torch.save_file` (tensors ordered by
    alignment, then name; header padded to 8 bytes), but the tensor bytes go to the
    file straight from the (pinned) host buffers with `os.write`, which releases
    the GIL: no serialized copy in memory, and the forward's thread keeps running.
    `fsync` puts the data on disk before the rename (durable across a power loss; the
    writer thread then runs at the disk's pace).
    """
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise TypeError("safetensors metadata must map str to str")
    items = []
    for name, t in tensors.items():
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        items.append((name, t.contiguous()))
    items.sort(key=lambda kv: (-kv[1].element_size(), kv[0]))
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, t in items:
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with atomic_path(path) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, struct.pack("<Q", len(raw)) + raw)
            for _, t in items:
                if t.numel():
                    _write_all(fd, t.reshape(-1).view(torch.uint8).numpy())
            if fsync:
                os.fdatasync(fd)
        finally:
            os.close(fd)
    return 8 + len(raw) + offset


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


def validate_sample(path: Path, input_ids: list[int] | None, hidden_size: int, dtype: torch.dtype) -> bool:
    """True when the file is a complete sample of the contract (for these ids, when given)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            if set(f.keys()) != set(KEYS):
                return False
            t = f.get_slice("input_ids").get_shape()[0]
            ok = (
                f.get_slice("loss_mask").get_shape() == [t]
                and f.get_slice("aux_hidden_states").get_shape() == [t, 3 * hidden_size]
                and f.get_slice("last_hidden_state").get_shape() == [t, hidden_size]
                and f.get_slice("aux_hidden_states").get_dtype() == DTYPE_NAMES[dtype]
            )
            if ok and input_ids is not None:
                ok = f.get_tensor("input_ids").tolist() == list(input_ids)
        return ok and path.stat().st_size > 0
    except Exception:  # truncated or garbage: not valid, will be rewritten
        return False


def read_sample(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def write_manifest(shard_dir: Path, row_ids: list[int]) -> pl.DataFrame:
    import polars as pl

    rows = []
    for r in sorted(row_ids):
        p = sample_file(shard_dir, r)
        with safe_open(str(p), framework="pt") as f:
            tokens = f.get_slice("input_ids").get_shape()[0]
        rows.append({"row_id": r, "file": p.name, "tokens": tokens, "bytes": p.stat().st_size})
    df = pl.DataFrame(rows, schema={"row_id": pl.Int64, "file": pl.Utf8, "tokens": pl.Int64, "bytes": pl.Int64})
    atomic_write_parquet(df, shard_dir / MANIFEST)
    return df


def check_free_space(shard_dir: Path, needed: int) -> None:
    free = shutil.disk_usage(shard_dir).free
    if needed > free:
        raise DiskSpaceError(
            f"shard {shard_dir.name} needs about {needed:,} bytes ({needed / 1e9:.2f} GB) but the filesystem "
            f"of {shard_dir} has {free:,} bytes ({free / 1e9:.2f} GB) free; free space or set storage_root elsewhere"
        )


def plan_shard(
    generations: pl.DataFrame, shard_dir: Path, hidden_size: int, dtype: torch.dtype
) -> tuple[list[tuple[int, list[int], list[int]]], int]:
    """Samples still to extract (valid files are kept), and how many were resumed."""
    shard_dir.mkdir(parents=True, exist_ok=True)
    remove_temporaries(shard_dir)
    wanted = {sample_file(shard_dir, r).name for r in generations["row_id"]}
    for p in shard_dir.glob("*.safetensors"):
        if p.name not in wanted:
            p.unlink()  # from an earlier, different version of this shard
    todo, resumed = [], 0
    for row in generations.iter_rows(named=True):
        path = sample_file(shard_dir, row["row_id"])
        if path.exists():
            if validate_sample(path, row["input_ids"], hidden_size, dtype):
                resumed += 1
                continue
            path.unlink()  # truncated or stale: redo it
        todo.append((row["row_id"], list(row["input_ids"]), list(row["loss_mask"])))
    return todo, resumed




@dataclass
class SampleRef:
    path: Path
    tokens: int


def list_samples(shard_dirs: list[str | Path]) -> list[SampleRef]:
    """Sample files of each shard: from its manifest when present, else a glob."""
    import polars as pl

    refs = []
    for shard_dir in map(Path, shard_dirs):
        if not shard_dir.is_dir():
            raise FileNotFoundError(f"hidden-state shard directory not found: {shard_dir}")
        manifest = shard_dir / MANIFEST
        if manifest.exists():
            df = pl.read_parquet(manifest, columns=["file", "tokens"])
            for file, tokens in df.iter_rows():
                path = Path(file) if Path(file).is_absolute() else shard_dir / file
                refs.append(SampleRef(path, int(tokens)))
        else:
            for path in sorted(shard_dir.glob("*.safetensors")):
                with safe_open(str(path), framework="pt") as f:
                    refs.append(SampleRef(path, f.get_slice("input_ids").get_shape()[0]))
    if not refs:
        raise ValueError(f"no hidden-state samples found in {[str(d) for d in shard_dirs]}")
    return refs


def read_sample_slices(path: Path, max_length: int | None = None) -> dict[str, torch.Tensor]:
    """The contract's tensors of one sample file, truncated to `max_length` tokens."""
    with safe_open(str(path), framework="pt") as f:
        return {key: f.get_slice(key)[:max_length] for key in KEYS}
