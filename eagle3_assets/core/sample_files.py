"""The hidden-state file contract: one safetensors file per sample, a manifest written last.

Per sample, `<shard_dir>/<row_id:07d>.safetensors` holds `input_ids` int32 [T], `loss_mask`
uint8 [T], `aux_hidden_states` [T, 3H] (the three aux layers, concatenated) and the teacher:
`last_hidden_state` [T, H] (after the final norm, so target logits = lm_head(last_hidden_state)).
The safetensors metadata names the target, the layer ids, the dtype and the format version.
Files are written under a temporary name and renamed: a file that exists is complete.
The metadata also carries `checksum`, the crc32 of the file's data section, written with it.
`manifest.parquet` (row_id, file, tokens, bytes, checksum) is written last and marks the shard
complete: `damaged_files` compares sizes with it (one stat per file), `verify_checksums` reads
every file against its checksums.

Layouts (`SampleLayout`; `extraction.storage` x `extraction.teacher`):

- storage `bf16`: the hidden states in the extraction dtype (bfloat16 unless set otherwise).
  storage `fp8`: float8 e4m3 with a float32 scale per token and layer beside them,
  `aux_scales` [T, 3] and `last_scale` [T, 1] (x = fp8 * scale).
- teacher `last_hidden`: `last_hidden_state` as above. Teacher `topk`: in its place the target's
  top-k next-token log-probabilities (under its full distribution) at the k most likely draft
  tokens, `topk_ids` uint16 [T, k] (draft ids) and `topk_logprobs` float16 [T, k], and
  `target_in_draft` uint8 [T] (1 where the target's full-vocabulary argmax is a draft token).

Format version "1" is bf16 + last_hidden (every file written before the other layouts existed);
"2" is any other layout, named in the metadata (`storage`, `teacher`, `topk`, `draft_vocab`: the
fingerprint of the vocab map whose draft ids the file holds). Readers take every version.

Every reader and checker of those files goes through this module: the extraction engine
encodes with `encode_features` and writes with `write_sample`, resume keeps what
`validate_sample` accepts, training reads with `list_samples`/`read_sample_slices`, and the
disk preflight, the plan and the checks predict bytes with `SampleLayout.predict_bytes`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from .files import atomic_path, atomic_write_parquet, remove_temporaries

if TYPE_CHECKING:  # polars is imported where it is used: the engine's writers do not need it
    import polars as pl

MANIFEST = "manifest.parquet"
CHECKSUM_KEY = "checksum"  # in a file's safetensors metadata: crc32 of its data section
STORAGES = ("bf16", "fp8")
TEACHERS = ("last_hidden", "topk")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest float8 e4m3fn value: a token's largest |x| in a layer maps to it
SCALE_DTYPE = torch.float32  # 4 bytes per token and layer: exact scales for a few bytes more than bf16
TOPK_ID_DTYPE = torch.uint16  # draft ids: a draft vocabulary has at most 65,536 tokens
TOPK_VALUE_DTYPE = torch.float16  # log-probabilities in [-1e4, 0]: fp16 keeps 11 significant bits, bf16 8
MAX_DRAFT_VOCAB = 65536
# k of the top-k teacher. 64 x 4 bytes (uint16 id + float16 value) is 1-2% of an fp8 token of an
# 8B-1T target (where storage matters), and keeps on average 97% of the draft distribution that
# training fits, where 32 keeps 95% (SmolLM2 teacher-forced on ShareGPT answers, a conservative
# setting: benchmarks/results/topk_mass_smollm2_cpu.json). The tau comparison is still to measure.
DEFAULT_TOPK = 64
# Bytes a file may hold beyond its tensors: the safetensors JSON header (tensor names, shapes,
# offsets, the metadata with the target's name) and its alignment; a bound, used by the disk
# preflight, the plan and the checks alike.
HEADER_BYTES_PER_FILE = 2048
DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_ST_NAMES = {**DTYPE_NAMES, torch.int32: "I32", torch.uint8: "U8", torch.uint16: "U16", FP8: "F8_E4M3"}


class DiskSpaceError(OSError):
    pass


@dataclass(frozen=True)
class SampleLayout:
    """Which tensors a sample file holds, in which dtypes and shapes, and what a token costs."""

    hidden_size: int
    dtype: torch.dtype = torch.bfloat16  # the hidden states' dtype with storage "bf16"
    storage: str = "bf16"
    teacher: str = "last_hidden"
    topk: int = DEFAULT_TOPK  # teacher "topk" only
    draft_vocab: str | None = None  # teacher "topk": the vocab map's fingerprint; None: not checked
    aux_layers: int = 3

    def __post_init__(self):
        if self.storage not in STORAGES or self.teacher not in TEACHERS:
            raise ValueError(f"unknown layout storage={self.storage!r} teacher={self.teacher!r}; "
                             f"storage is one of {STORAGES}, teacher one of {TEACHERS}")
        if self.teacher == "topk" and not 1 <= self.topk <= MAX_DRAFT_VOCAB:
            raise ValueError(f"topk must be in 1..{MAX_DRAFT_VOCAB}, got {self.topk}")

    @property
    def name(self) -> str:
        """e.g. "bf16/last_hidden", "fp8/topk64" ("fp32/..." for float32 files of storage bf16)."""
        stored = "fp8" if self.storage == "fp8" else _SHORT[self.dtype]
        return f"{stored}/" + (f"topk{self.topk}" if self.teacher == "topk" else self.teacher)

    @property
    def format_version(self) -> str:
        return "1" if (self.storage, self.teacher) == ("bf16", "last_hidden") else "2"

    def tensors(self, tokens: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Every tensor of a file of `tokens` tokens: name -> (dtype, shape)."""
        h, n, fp8 = self.hidden_size, self.aux_layers, self.storage == "fp8"
        hidden = FP8 if fp8 else self.dtype
        out = {"input_ids": (torch.int32, (tokens,)), "loss_mask": (torch.uint8, (tokens,)),
               "aux_hidden_states": (hidden, (tokens, n * h))}
        if fp8:
            out["aux_scales"] = (SCALE_DTYPE, (tokens, n))
        if self.teacher == "last_hidden":
            out["last_hidden_state"] = (hidden, (tokens, h))
            if fp8:
                out["last_scale"] = (SCALE_DTYPE, (tokens, 1))
        else:
            out["topk_ids"] = (TOPK_ID_DTYPE, (tokens, self.topk))
            out["topk_logprobs"] = (TOPK_VALUE_DTYPE, (tokens, self.topk))
            out["target_in_draft"] = (torch.uint8, (tokens,))
        return out

    def bytes_per_token(self) -> int:
        """Tensor bytes one token costs in a sample file (headers not included)."""
        return sum(dtype.itemsize * math.prod(shape) for dtype, shape in self.tensors(1).values())

    def predict_bytes(self, tokens: int, samples: int) -> int:
        """Bytes of `samples` files holding `tokens` tokens in all: the tensors exactly, the headers
        bounded. The disk preflight, `eagle3 plan` and the shard check use this one prediction."""
        return tokens * self.bytes_per_token() + samples * HEADER_BYTES_PER_FILE

    def metadata(self) -> dict[str, str]:
        """The layout's entries in a file's safetensors metadata."""
        meta = {"format_version": self.format_version}
        if self.format_version != "1":
            meta.update(storage=self.storage, teacher=self.teacher)
            if self.teacher == "topk":
                meta.update(topk=str(self.topk), draft_vocab=self.draft_vocab or "")
        return meta


def sample_file(shard_dir: Path, row_id: int) -> Path:
    return shard_dir / f"{row_id:07d}.safetensors"


# ---------------------------------------------------------------------------------------------
# Encoding: what the engine computes on the device, and its inverse for the readers


def quantize_fp8(x: torch.Tensor, layers: int, chunk_rows: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, layers*H] -> (float8 e4m3 [N, layers*H], float32 scales [N, layers]), one scale per
    token and layer: that row's largest |x| maps to 448, so x = q * scale within fp8's 3-bit
    mantissa (relative error <= 2^-4, plus 2^-10 * scale near zero). Rows are done in chunks so
    the float32 temporaries of a 64k-token pack stay small."""
    n, width = x.shape
    h = width // layers
    q = torch.empty((n, width), dtype=FP8, device=x.device)
    scale = torch.empty((n, layers), dtype=SCALE_DTYPE, device=x.device)
    for s in range(0, n, chunk_rows):
        xs = x[s : s + chunk_rows].reshape(-1, layers, h).float()
        # An all-zero row gets the smallest normal scale instead of 0: a valid file never holds a
        # zero scale, so one is a sign of damage.
        sc = (xs.abs().amax(-1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        q[s : s + chunk_rows] = (xs / sc[..., None]).clamp(-FP8_MAX, FP8_MAX).reshape(-1, width).to(FP8)
        scale[s : s + chunk_rows] = sc
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [..., layers*H] float8 with scale [..., layers] -> [..., layers*H] in `dtype` (any leading
    dims: one sample [T, ...] or a padded batch [B, T, ...])."""
    layers = scale.shape[-1]
    x = q.reshape(*q.shape[:-1], layers, -1).float() * scale.float()[..., None]
    return x.reshape(q.shape).to(dtype)


def encode_features(aux: torch.Tensor, last: torch.Tensor, layout: SampleLayout, teacher=None) -> dict[str, torch.Tensor]:
    """A pack's rows as the layout stores them (on the rows' device): aux [N, 3H] and last [N, H]
    (after the final norm) -> the file's tensors but input_ids and loss_mask, each [N, ...].
    `teacher(last)` gives the top-k tensors for teacher "topk" (`extract_engine.TopkTeacher`)."""
    out = {}
    if layout.storage == "fp8":
        out["aux_hidden_states"], out["aux_scales"] = quantize_fp8(aux, layout.aux_layers)
    else:
        out["aux_hidden_states"] = aux.to(layout.dtype)
    if layout.teacher == "last_hidden":
        if layout.storage == "fp8":
            out["last_hidden_state"], out["last_scale"] = quantize_fp8(last, 1)
        else:
            out["last_hidden_state"] = last.to(layout.dtype)
    else:
        if teacher is None:
            raise ValueError("teacher 'topk' needs the top-k teacher (the target's lm_head and the vocab map)")
        out.update(teacher(last))
    return out


def dequantize_features(tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """fp8 hidden states times their scales, in `dtype`, under the same keys as bf16 files (the
    scales are dropped); every other tensor as it is. Works on one sample or a padded batch."""
    out = dict(tensors)
    for key, scale_key in (("aux_hidden_states", "aux_scales"), ("last_hidden_state", "last_scale")):
        if scale_key in out:
            out[key] = dequantize_fp8(out[key], out.pop(scale_key), dtype)
    return out


# ---------------------------------------------------------------------------------------------
# Writing


def write_sample(
    path: Path, input_ids, loss_mask, features: dict[str, torch.Tensor], metadata: dict[str, str], fsync: bool = False
) -> int:
    """One sample file: its ids and loss mask, and `features` as `encode_features` made them."""
    tensors = {
        "input_ids": torch.as_tensor(input_ids, dtype=torch.int32),
        "loss_mask": torch.as_tensor(loss_mask, dtype=torch.uint8),
        **features,
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
    # The checksum of the data section (every tensor's bytes, in file order) goes in the header
    # written before it: the file carries it, and the manifest copies it.
    crc = 0
    for _, t in items:
        if t.numel():
            crc = zlib.crc32(t.reshape(-1).view(torch.uint8).numpy(), crc)
    header: dict = {"__metadata__": {**(metadata or {}), CHECKSUM_KEY: _checksum_text(crc)}}
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


def _checksum_text(crc: int) -> str:
    return f"crc32:{crc:08x}"


def stored_checksum(path: Path) -> str | None:
    """The checksum a sample file carries in its header (None: written before checksums existed)."""
    with safe_open(str(path), framework="pt") as f:
        return (f.metadata() or {}).get(CHECKSUM_KEY)


def checksum_problem(path: Path, size: int | None = None, checksum: str | None = None) -> str | None:
    """What is wrong with one sample file, reading all of it, or None: missing, not the size or the
    checksum the manifest recorded (`size`, `checksum`), a header that does not parse, or data that
    does not match the checksum written with it."""
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        return "missing"
    if size is not None and actual != size:
        return f"{actual:,} bytes, the manifest recorded {size:,}"
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
            crc = 0
            while chunk := f.read(1 << 22):
                crc = zlib.crc32(chunk, crc)
    except (OSError, ValueError, struct.error) as e:
        return f"unreadable header ({type(e).__name__}: {e})"
    written = (header.get("__metadata__") or {}).get(CHECKSUM_KEY)
    if checksum and written != checksum:
        return f"its header's checksum {written} is not the manifest's {checksum}"
    if written is None:
        return None if checksum is None else "no checksum in its header"
    if _checksum_text(crc) != written:
        return f"data checksum {_checksum_text(crc)} does not match the {written} written with it"
    return None


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


def validate_sample(path: Path, input_ids: list[int] | None, layout: SampleLayout) -> bool:
    """True when the file is a complete sample of `layout` (for these ids, when given): every
    tensor of the layout in its dtype and shape and no other, the layout's format version (and
    for topk its k and vocab map), and fp8 scales finite and positive."""
    try:
        with safe_open(str(path), framework="pt") as f:
            t = f.get_slice("input_ids").get_shape()[0]
            want = layout.tensors(t)
            if set(f.keys()) != set(want):
                return False
            for key, (dtype, shape) in want.items():
                sl = f.get_slice(key)
                if sl.get_shape() != list(shape) or sl.get_dtype() != _ST_NAMES[dtype]:
                    return False
            meta = f.metadata() or {}
            if meta.get("format_version", "1") != layout.format_version:
                return False
            if layout.teacher == "topk" and layout.draft_vocab and meta.get("draft_vocab") != layout.draft_vocab:
                return False  # top-k over another draft vocabulary
            for key in ("aux_scales", "last_scale"):
                if key in want:
                    s = f.get_tensor(key)
                    if not bool((torch.isfinite(s) & (s > 0)).all()):
                        return False
            if input_ids is not None and f.get_tensor("input_ids").tolist() != list(input_ids):
                return False
        return path.stat().st_size > 0
    except Exception:  # truncated or garbage: not valid, will be rewritten
        return False


def read_sample(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a file as stored (fp8 stays fp8): see `read_sample_slices` to decode."""
    from safetensors.torch import load_file

    return load_file(str(path))


def write_manifest(shard_dir: Path, row_ids: list[int]) -> pl.DataFrame:
    import polars as pl

    rows = []
    for r in sorted(row_ids):
        p = sample_file(shard_dir, r)
        with safe_open(str(p), framework="pt") as f:
            tokens = f.get_slice("input_ids").get_shape()[0]
            checksum = (f.metadata() or {}).get(CHECKSUM_KEY)
        rows.append({"row_id": r, "file": p.name, "tokens": tokens, "bytes": p.stat().st_size, "checksum": checksum})
    df = pl.DataFrame(rows, schema={"row_id": pl.Int64, "file": pl.Utf8, "tokens": pl.Int64, "bytes": pl.Int64,
                                    "checksum": pl.Utf8})
    atomic_write_parquet(df, shard_dir / MANIFEST)
    return df


def read_manifest(shard_dir: Path) -> pl.DataFrame | None:
    import polars as pl

    path = shard_dir / MANIFEST
    if not path.is_file():
        return None
    df = pl.read_parquet(path)
    return df if "checksum" in df.columns else df.with_columns(checksum=pl.lit(None, pl.Utf8))


def damaged_files(shard_dir: Path) -> list[tuple[str, str]]:
    """Cheap, from the manifest and one stat per file: the sample files of a complete shard that
    are missing or not the size the manifest recorded, as (name, what). [] without a manifest."""
    df = read_manifest(shard_dir)
    out = []
    for file, size in ([] if df is None else df.select("file", "bytes").iter_rows()):
        try:
            actual = (shard_dir / file).stat().st_size
        except FileNotFoundError:
            out.append((file, "missing"))
            continue
        if actual != size:
            out.append((file, f"{actual:,} bytes, the manifest recorded {size:,}"))
    return out


def shard_damage(shard_dir: Path) -> str | None:
    """Why a shard that was complete is not any more (its manifest or files gone or resized), or None."""
    if not (shard_dir / MANIFEST).is_file():
        return f"its manifest {shard_dir / MANIFEST} is missing"
    damaged = damaged_files(shard_dir)
    if not damaged:
        return None
    return (f"{len(damaged)} sample file(s) missing or resized since its manifest: "
            + "; ".join(f"{name} {what}" for name, what in damaged[:3]) + ("; ..." if len(damaged) > 3 else ""))


def verify_checksums(shard_dir: Path) -> list[tuple[str, str]]:
    """Full strength: every sample file of the manifest read whole and checked against the size and
    checksum recorded there and the checksum written in it, as (name, what) for each bad one."""
    df = read_manifest(shard_dir)
    if df is None:
        return [(MANIFEST, "missing (the shard never finished)")]
    return [(file, problem) for file, size, checksum in df.select("file", "bytes", "checksum").iter_rows()
            if (problem := checksum_problem(shard_dir / file, size, checksum))]


class DamagedSampleError(OSError):
    """A sample file that cannot be read; `path` names it."""

    def __init__(self, path: Path, cause: BaseException):
        self.path = Path(path)
        super().__init__(f"sample file {path} cannot be read ({type(cause).__name__}: {cause}); it is damaged or "
                         "was changed after extraction")


def check_free_space(shard_dir: Path, needed: int, shards: list[str] | None = None) -> None:
    """`needed` bytes (of every shard of the run: `shards`) fit on `shard_dir`'s filesystem."""
    free = shutil.disk_usage(shard_dir).free
    if needed > free:
        what = f"shard {shard_dir.name} needs" if not shards or len(shards) == 1 else \
            f"the {len(shards)} shards of this run ({', '.join(shards)}) need"
        raise DiskSpaceError(
            f"{what} about {needed:,} bytes ({needed / 1e9:.2f} GB) but the filesystem "
            f"of {shard_dir} has {free:,} bytes ({free / 1e9:.2f} GB) free; free space or set storage_root elsewhere"
        )


def plan_shard(
    generations: pl.DataFrame, shard_dir: Path, layout: SampleLayout, redo: bool = False
) -> tuple[list[tuple[int, list[int], list[int]]], int]:
    """Samples still to extract (valid files of this layout are kept; files of another layout, or
    damaged ones, are redone; `redo` redoes them all), and how many were resumed."""
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
            if not redo and validate_sample(path, row["input_ids"], layout):
                resumed += 1
                continue
            path.unlink()  # truncated, damaged, of another layout, or asked for again: redo it
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


def read_sample_slices(path: Path, max_length: int | None = None, dequantize: bool = True) -> dict[str, torch.Tensor]:
    """The tensors of one sample file, truncated to `max_length` tokens. With `dequantize` (the
    default) fp8 hidden states come back as float32 under the same keys as bf16 files; without,
    as stored with their scales (training moves them so and decodes on its device)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {key: f.get_slice(key)[:max_length] for key in f.keys()}
    except Exception as e:  # SafetensorError says "incomplete metadata", not which file
        raise DamagedSampleError(path, e) from e
    return dequantize_features(tensors) if dequantize else tensors
