"""Hidden-state extraction: the file contract and the engine that writes it.

Per sample, `<shard_dir>/<row_id:07d>.safetensors` holds `input_ids` int32 [T],
`loss_mask` uint8 [T], `aux_hidden_states` [T, 3H] (the three aux layers,
concatenated) and `last_hidden_state` [T, H] (after the final norm, so target
logits = lm_head(last_hidden_state)). Files are written under a temporary name
and renamed: a file that exists is complete. `manifest.parquet` (row_id, file,
tokens, bytes) is written last and marks the shard complete.

The engine runs the base model only (no LM head, no logits), captures the aux
layers with forward hooks instead of `output_hidden_states` over every layer,
packs length-sorted samples into batches of about `batch_tokens`, and hands the
outputs to a bounded pool of writer threads so the forward never waits on disk.
"""

from __future__ import annotations

import os
import shutil
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import polars as pl
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .files import atomic_write_parquet, bytes_on_disk, remove_temporaries, tmp_name

FORMAT_VERSION = "1"
MANIFEST = "manifest.parquet"
KEYS = ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state")
DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


class DiskSpaceError(OSError):
    pass


def sample_file(shard_dir: Path, row_id: int) -> Path:
    return shard_dir / f"{row_id:07d}.safetensors"


def bytes_per_token(hidden_size: int, dtype: torch.dtype) -> int:
    """Tensor bytes one token costs in a sample file (headers not included)."""
    item = torch.empty((), dtype=dtype).element_size()
    return 4 + 1 + 4 * hidden_size * item  # input_ids + loss_mask + 3H aux + H last


# ---------------------------------------------------------------------------------------------
# Capturing the layers


class LayerCapture:
    """Forward hooks that keep the outputs at Hugging Face `hidden_states` indices.

    Index 0 is the embeddings, j is the output of decoder layer j-1, and the last
    index (num_layers) is after the final norm, exactly as `output_hidden_states`.
    """

    def __init__(self, base_model, layer_ids: list[int]):
        self.layer_ids = list(layer_ids)
        self.outputs: dict[int, torch.Tensor] = {}
        layers = base_model.layers
        self._handles = []
        for j in sorted(set(layer_ids)):
            module = base_model.embed_tokens if j == 0 else base_model.norm if j == len(layers) else layers[j - 1]
            self._handles.append(module.register_forward_hook(self._hook(j)))

    def _hook(self, j: int):
        def hook(module, args, output):
            self.outputs[j] = output[0] if isinstance(output, tuple) else output

        return hook

    def take(self) -> torch.Tensor:
        """The captured layers concatenated on the last dim, in `layer_ids` order."""
        out = torch.cat([self.outputs[j] for j in self.layer_ids], dim=-1)
        self.outputs.clear()
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def forward_batch(base_model, capture: LayerCapture, batch: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Run right-padded samples; returns (aux [B, T, 3H], last [B, T, H]) on the device.

    Right padding leaves every real position's causal context untouched; the
    attention mask keeps the padded keys out of the softmax.
    """
    width = max(len(ids) for ids in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, s in enumerate(batch):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    with torch.inference_mode():
        out = base_model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
    return capture.take(), out.last_hidden_state


def plan_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Group sample indices, sorted by length, into batches of at most `batch_tokens` padded tokens."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    batches, cur, width = [], [], 0
    for i in order:
        w = max(width, lengths[i])
        if cur and w * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, w = [], lengths[i]
        cur.append(i)
        width = w
    if cur:
        batches.append(cur)
    return batches


# ---------------------------------------------------------------------------------------------
# Files


def write_sample(path: Path, input_ids, loss_mask, aux: torch.Tensor, last: torch.Tensor, metadata: dict[str, str]) -> int:
    tensors = {
        "input_ids": torch.as_tensor(input_ids, dtype=torch.int32),
        "loss_mask": torch.as_tensor(loss_mask, dtype=torch.uint8),
        "aux_hidden_states": aux.contiguous(),
        "last_hidden_state": last.contiguous(),
    }
    tmp = tmp_name(path)
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size


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


# ---------------------------------------------------------------------------------------------
# The engine


class DiskProgress:
    """Progress read from the disk: what the files say, never a counter kept on the side.

    Counts the shard's sample files that exist under their final names (so all
    ranks' work, and samples resumed from an earlier run), their tokens and bytes.
    """

    def __init__(self, shard_dir: Path, tokens_by_row: dict[int, int]):
        self.shard_dir = shard_dir
        self.tokens_by_name = {sample_file(shard_dir, r).name: t for r, t in tokens_by_row.items()}
        self.total_tokens = sum(tokens_by_row.values())
        self.started = time.perf_counter()
        self.history: deque[tuple[float, int]] = deque(maxlen=1024)
        self.baseline: int | None = None

    def scan(self) -> tuple[int, int, int]:
        done = tokens = nbytes = 0
        with os.scandir(self.shard_dir) as it:
            for e in it:
                t = self.tokens_by_name.get(e.name)
                if t is not None:
                    done += 1
                    tokens += t
                    nbytes += e.stat().st_size
        return done, tokens, nbytes

    def line(self) -> str:
        done, tokens, nbytes = self.scan()
        now = time.perf_counter()
        if self.baseline is None:
            self.baseline = tokens  # resumed samples are not this run's throughput
        self.history.append((now, tokens))
        overall = (tokens - self.baseline) / max(now - self.started, 1e-9)
        past = [(t, n) for t, n in self.history if now - t <= 10.0]
        t0, n0 = past[0]
        window = (tokens - n0) / (now - t0) if now - t0 > 0.5 else overall
        eta = (self.total_tokens - tokens) / overall if overall > 0 else float("nan")
        return (
            f"{done}/{len(self.tokens_by_name)} samples, {tokens:,}/{self.total_tokens:,} tokens, "
            f"{window:,.0f} tok/s (last 10 s), {overall:,.0f} tok/s overall, ETA {eta:,.0f} s, "
            f"{nbytes:,} bytes on disk"
        )


def extract_samples(
    base_model,
    samples: list[tuple[int, list[int], list[int]]],
    shard_dir: Path,
    *,
    aux_layer_ids: list[int],
    dtype: torch.dtype,
    batch_tokens: int,
    writer_threads: int,
    metadata: dict[str, str],
) -> None:
    """Extract and write `samples` (row_id, input_ids, loss_mask) into shard_dir."""
    device = next(base_model.parameters()).device
    capture = LayerCapture(base_model, aux_layer_ids)
    pending: deque[Future] = deque()
    max_pending = 2 * writer_threads  # backpressure: at most this many batches held in host memory

    def write_batch(batch, aux, last, ready):
        if ready is not None:
            ready.synchronize()  # the async device->host copy has landed
        for i, (row_id, ids, mask) in enumerate(batch):
            t = len(ids)
            write_sample(sample_file(shard_dir, row_id), ids, mask, aux[i, :t], last[i, :t], metadata)

    try:
        with ThreadPoolExecutor(writer_threads, thread_name_prefix="writer") as pool:
            for idx in plan_batches([len(s[1]) for s in samples], batch_tokens):
                batch = [samples[i] for i in idx]
                aux, last = forward_batch(base_model, capture, [s[1] for s in batch], device)
                aux, last, ready = _to_host(aux.to(dtype), last.to(dtype))
                pending.append(pool.submit(write_batch, batch, aux, last, ready))
                while len(pending) >= max_pending:
                    pending.popleft().result()  # raises a writer's error (e.g. disk full) here
            while pending:
                pending.popleft().result()
    finally:
        capture.remove()


def _to_host(*tensors: torch.Tensor):
    if tensors[0].device.type != "cuda":
        return (*tensors, None)
    # Pinned buffers let the copy run asynchronously; the writer waits on the event, not the forward.
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for h, t in zip(host, tensors):
        h.copy_(t, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return (*host, ready)


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


def shard_bytes_on_disk(shard_dir: Path) -> int:
    return bytes_on_disk(shard_dir)

