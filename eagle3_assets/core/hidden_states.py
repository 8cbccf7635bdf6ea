"""Hidden-state extraction: the file contract and the engine that writes it.

Per sample, `<shard_dir>/<row_id:07d>.safetensors` holds `input_ids` int32 [T],
`loss_mask` uint8 [T], `aux_hidden_states` [T, 3H] (the three aux layers,
concatenated) and `last_hidden_state` [T, H] (after the final norm, so target
logits = lm_head(last_hidden_state)). Files are written under a temporary name
and renamed: a file that exists is complete. `manifest.parquet` (row_id, file,
tokens, bytes) is written last and marks the shard complete.

The engine runs the base model only (no LM head, no logits). For Llama-family
models it runs a lean forward over the model's own weights: length-sorted samples
are packed end to end into sequences of about `batch_tokens` tokens with no
padding (the linear layers see one large matrix; attention runs per sample, so
every sample's result is that of an unbatched run), fused RMSNorm, and the aux
layers are copied straight into the output buffer. Other models fall back to the
Hugging Face forward, one sample at a time, with forward hooks. The outputs go to
pinned host buffers on a side CUDA stream and a pool of writer threads serializes
the safetensors files straight from those buffers (no extra copy, and the GIL is
released during the writes), so the forward never waits on disk; a fixed number
of staging buffers bounds the memory (backpressure when the disk is slower).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import struct
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from safetensors import safe_open

from .files import atomic_write_parquet, remove_temporaries, tmp_name

if TYPE_CHECKING:  # polars is imported where it is used: the engine itself does not need it
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


# ---------------------------------------------------------------------------------------------
# Files


def write_sample(
    path: Path, input_ids, loss_mask, aux: torch.Tensor, last: torch.Tensor, metadata: dict[str, str], fsync: bool = False
) -> int:
    tensors = {
        "input_ids": torch.as_tensor(input_ids, dtype=torch.int32),
        "loss_mask": torch.as_tensor(loss_mask, dtype=torch.uint8),
        "aux_hidden_states": aux,
        "last_hidden_state": last,
    }
    return _write_safetensors(path, tensors, metadata, fsync)


def _write_safetensors(
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
    tmp = tmp_name(path)
    try:
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
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
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
        eta = f"{(self.total_tokens - tokens) / overall:,.0f} s" if overall > 0 else "unknown"
        return (
            f"{done}/{len(self.tokens_by_name)} samples, {tokens:,}/{self.total_tokens:,} tokens, "
            f"{window:,.0f} tok/s (last 10 s), {overall:,.0f} tok/s overall, ETA {eta}, "
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
    staging_buffers: int = 3,
    lean: bool | None = None,
    fsync: bool = False,
    write: bool = True,
) -> None:
    """Extract and write `samples` (row_id, input_ids, loss_mask) into shard_dir.

    `batch_tokens` is the size of one packed forward (a longer sample runs alone);
    `staging_buffers` host buffers of that size bound the memory: when the writers
    fall behind, the forward waits for a free buffer. `lean=None` uses the lean
    forward where the model supports it (`lean_supported`), False forces the
    Hugging Face forward (one sample at a time, hooks). `fsync=True` makes each file
    durable before its rename (the writers then wait on the disk, the forward does not
    until the staging buffers are all taken). `write=False` runs the same forwards and
    writes nothing: the other ranks of a tensor-parallel group, whose collectives must
    match rank 0's.
    """
    shard_dir = Path(shard_dir)
    if not samples:
        return
    use_lean = lean_supported(base_model) if lean is None else lean
    device = next(base_model.parameters()).device
    hidden = base_model.config.hidden_size
    lengths = [len(s[1]) for s in samples]
    if use_lean:
        packs = plan_packs(lengths, batch_tokens)
        capture = None
    else:
        packs = [[i] for i in sorted(range(len(samples)), key=lambda i: lengths[i], reverse=True)]
        capture = LayerCapture(base_model, aux_layer_ids)
    capacity = max(sum(lengths[i] for i in p) for p in packs)
    staging = _Staging(max(1, staging_buffers), capacity, len(aux_layer_ids), hidden, dtype, device)
    copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    futures: deque[Future] = deque()

    def reap(block: bool = False) -> None:
        while futures and (block or futures[0].done()):
            futures.popleft().result()  # raises a writer's error (e.g. disk full) here

    try:
        with ThreadPoolExecutor(max(1, writer_threads), thread_name_prefix="writer") as pool:
            for pack in packs:
                items = [samples[i] for i in pack]
                slot = staging.acquire(reap)
                if use_lean:
                    aux_dev, last_dev = lean_forward(base_model, [s[1] for s in items], aux_layer_ids, dtype)
                else:
                    aux_b, last_b = forward_batch(base_model, capture, [items[0][1]], device)
                    aux_dev, last_dev = aux_b[0].to(dtype), last_b[0].to(dtype)
                if not write:
                    staging.release(slot)
                    continue
                host_aux, host_last, ready = staging.stage(slot, aux_dev, last_dev, copy_stream)
                del aux_dev, last_dev
                countdown = _Countdown(len(items), lambda slot=slot: staging.release(slot))
                off = 0
                for row_id, ids, mask in items:
                    t = len(ids)
                    futures.append(
                        pool.submit(
                            _write_staged, sample_file(shard_dir, row_id), ids, mask,
                            host_aux[off : off + t], host_last[off : off + t], metadata, ready, countdown, fsync,
                        )
                    )
                    off += t
                reap()
            reap(block=True)
    finally:
        if capture is not None:
            capture.remove()


def plan_packs(lengths: list[int], pack_tokens: int) -> list[list[int]]:
    """Sample indices, longest first, packed end to end into groups of at most `pack_tokens`
    tokens (no padding; a longer sample is a group of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    packs, cur, used = [], [], 0
    for i in order:
        if cur and used + lengths[i] > pack_tokens:
            packs.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += lengths[i]
    if cur:
        packs.append(cur)
    return packs


def _write_staged(path, ids, mask, aux, last, metadata, ready, countdown, fsync=False) -> None:
    try:
        if ready is not None:
            ready.synchronize()  # the device->host copy has landed (releases the GIL while waiting)
        write_sample(path, ids, mask, aux, last, metadata, fsync)
    finally:
        countdown.done()


class _Countdown:
    def __init__(self, n: int, then):
        self.n, self.then, self.lock = n, then, threading.Lock()

    def done(self) -> None:
        with self.lock:
            self.n -= 1
            last = self.n == 0
        if last:
            self.then()


class _Staging:
    """A fixed number of host staging slots: pinned buffers of `capacity` tokens on CUDA
    (allocated on first use, reused after), plain tensors on the CPU. Taking a slot when
    none is free waits for the writers: that is the backpressure that bounds memory."""

    def __init__(self, n: int, capacity: int, n_aux: int, hidden: int, dtype: torch.dtype, device: torch.device):
        self.n, self.capacity, self.n_aux, self.hidden, self.dtype = n, capacity, n_aux, hidden, dtype
        self.pinned = device.type == "cuda"
        self.free: queue.Queue[int] = queue.Queue()
        for i in range(n):
            self.free.put(i)
        self.buffers: dict[int, torch.Tensor] = {}

    def acquire(self, poll) -> int:
        while True:
            try:
                return self.free.get(timeout=0.5)
            except queue.Empty:
                poll()  # a writer's error surfaces here instead of waiting forever

    def release(self, slot: int) -> None:
        self.free.put(slot)

    def stage(self, slot: int, aux: torch.Tensor, last: torch.Tensor, copy_stream):
        if not self.pinned:
            return aux, last, None
        n, h, k = aux.shape[0], self.hidden, self.n_aux
        buf = self.buffers.get(slot)
        if buf is None:
            buf = self.buffers[slot] = torch.empty(self.capacity * (k + 1) * h, dtype=self.dtype, pin_memory=True)
        host_aux = buf[: n * k * h].view(n, k * h)
        host_last = buf[n * k * h : n * (k + 1) * h].view(n, h)
        produced = torch.cuda.current_stream(aux.device).record_event()
        copy_stream.wait_event(produced)
        with torch.cuda.stream(copy_stream):
            host_aux.copy_(aux, non_blocking=True)
            host_last.copy_(last, non_blocking=True)
            ready = copy_stream.record_event()
        aux.record_stream(copy_stream)  # the allocator keeps them until the copy is done
        last.record_stream(copy_stream)
        return host_aux, host_last, ready


# ---------------------------------------------------------------------------------------------
# The lean forward (Llama family)


def lean_supported(base_model) -> bool:
    """True for a plain Hugging Face `LlamaModel` on one device with no dispatch hooks."""
    try:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaModel, LlamaRMSNorm
    except ImportError:
        return False
    cfg = base_model.config
    if type(base_model) is not LlamaModel or getattr(cfg, "hidden_act", None) != "silu":
        return False
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return False
    if any(hasattr(m, "_hf_hook") for m in base_model.modules()):
        return False
    if len({p.device for p in base_model.parameters()}) != 1:
        return False
    norms = [base_model.norm] + [n for l in base_model.layers for n in (l.input_layernorm, l.post_attention_layernorm)]
    return all(type(l) is LlamaDecoderLayer for l in base_model.layers) and all(type(n) is LlamaRMSNorm for n in norms)


def _rms(norm, x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    # x * cos + rotate_half(x) * sin, with rotate_half(x) * sin == roll(x, D/2) * [-sin1, sin2]
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)


@torch.inference_mode()
def lean_forward(base_model, seqs: list[list[int]], layer_ids: list[int], dtype: torch.dtype):
    """The base model over samples packed end to end; returns (aux [N, k*H], last [N, H]) in
    `dtype`, rows in `seqs` order. Token-wise ops see the whole pack; attention runs per
    sample (causal, positions restart at 0), so each sample's rows equal an unbatched run."""
    m = base_model
    device = next(m.parameters()).device
    cuda = device.type == "cuda"
    flat = [t for s in seqs for t in s]
    pos = [p for s in seqs for p in range(len(s))]
    ids = torch.tensor(flat, dtype=torch.long)
    positions = torch.tensor(pos, dtype=torch.long)
    if cuda:
        ids, positions = ids.pin_memory().to(device, non_blocking=True), positions.pin_memory().to(device, non_blocking=True)
    n_tok = len(flat)
    bounds, off = [], 0
    for s in seqs:
        bounds.append((off, off + len(s)))
        off += len(s)
    num_layers = len(m.layers)
    hidden = m.config.hidden_size
    slots: dict[int, list[int]] = {}
    for k, j in enumerate(layer_ids):
        slots.setdefault(j, []).append(k)
    aux = torch.empty((n_tok, len(layer_ids) * hidden), dtype=dtype, device=device)

    def keep(j: int, h: torch.Tensor) -> None:
        for k in slots.get(j, ()):
            aux[:, k * hidden : (k + 1) * hidden].copy_(h)

    h = m.embed_tokens(ids)
    keep(0, h)
    cos, sin = m.rotary_emb(h, positions[None])
    cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # [N, 1, D]
    half = sin.shape[-1] // 2
    sin_signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    for i, layer in enumerate(m.layers):
        a, mlp = layer.self_attn, layer.mlp
        x = _rms(layer.input_layernorm, h)
        d = a.head_dim
        q = F.linear(x, a.q_proj.weight, a.q_proj.bias).view(n_tok, -1, d)
        k_ = F.linear(x, a.k_proj.weight, a.k_proj.bias).view(n_tok, -1, d)
        v = F.linear(x, a.v_proj.weight, a.v_proj.bias).view(n_tok, -1, d)
        q, k_ = _rope(q, cos, sin_signed), _rope(k_, cos, sin_signed)
        gqa = q.shape[1] != k_.shape[1]
        if len(bounds) == 1:
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k_.transpose(0, 1)[None], v.transpose(0, 1)[None],
                is_causal=True, scale=a.scaling, enable_gqa=gqa,
            )[0].transpose(0, 1).reshape(n_tok, -1)
        else:
            o = torch.empty_like(q)
            for s, e in bounds:
                o[s:e] = F.scaled_dot_product_attention(
                    q[s:e].transpose(0, 1)[None], k_[s:e].transpose(0, 1)[None], v[s:e].transpose(0, 1)[None],
                    is_causal=True, scale=a.scaling, enable_gqa=gqa,
                )[0].transpose(0, 1)
            o = o.view(n_tok, -1)
        h = h + F.linear(o, a.o_proj.weight, a.o_proj.bias)
        x = _rms(layer.post_attention_layernorm, h)
        g = F.silu(F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias))
        g = g.mul_(F.linear(x, mlp.up_proj.weight, mlp.up_proj.bias))
        h = h + F.linear(g, mlp.down_proj.weight, mlp.down_proj.bias)
        del x, q, k_, v, o, g
        if i + 1 < num_layers:
            keep(i + 1, h)
    last = _rms(m.norm, h)
    keep(num_layers, last)  # HF convention: the last hidden_states index is after the final norm
    return aux, last.to(dtype)


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


