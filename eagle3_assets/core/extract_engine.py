"""The extraction engine: the target's hidden states for many samples, written at the disk's pace.

The engine runs the base model only (no LM head, no logits). Where `lean_supported`
says so, it runs the lean packed forward of `lean_forward.py`: length-sorted samples
are packed end to end into sequences of about `batch_tokens` tokens with no padding.
Other models (and tensor-parallel ones) fall back to the Hugging Face forward with forward
hooks, over right-padded batches of length-sorted samples (at most `batch_tokens` tokens
with the padding). The outputs go to pinned host buffers on a side CUDA stream and a pool
of writer threads serializes the safetensors files straight from those buffers (no extra
copy, and the GIL is released during the writes), so the forward never waits on disk; a
fixed number of staging buffers bounds the memory (backpressure when the disk is slower).

What is staged is what the file layout stores (`sample_files.encode_features`), computed on
the device before the copy: fp8 hidden states with their scales (half the bytes over the
bus and to disk), and for the top-k teacher the target's top-k log-probabilities over the
draft vocabulary (`TopkTeacher`) in place of the last hidden state.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from .lean_forward import lean_forward, lean_supported
from .sample_files import TOPK_ID_DTYPE, TOPK_VALUE_DTYPE, SampleLayout, encode_features, sample_file, write_sample
from .stopping import STOP, Stopped

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
    attention mask keeps the padded keys out of the softmax. Everything else is token-wise
    (MoE routing included), so a padded row changes no real one.
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


class TopkTeacher:
    """The target's top-k next-token log-probabilities over the draft vocabulary, on the device.

    From the final-norm hidden state and the target's lm_head: the full-vocabulary logits (in
    chunks of `chunk_tokens` rows, so a pack's [N, vocab] logits never exist at once), their
    log-softmax, the k largest at draft tokens (`topk_ids` are draft ids, `topk_logprobs` the
    log-probabilities under the full distribution), and whether the full-vocabulary argmax is a
    draft token (`target_in_draft`: training masks the other positions, as from the last
    hidden state). The logits are computed in the lm_head's dtype as training computes them.
    """

    def __init__(self, lm_head: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor, k: int, device,
                 dtype: torch.dtype, chunk_tokens: int = 2048):
        if not 1 <= k <= d2t.numel():
            raise ValueError(f"extraction.topk={k} must be between 1 and the draft vocabulary's size, {d2t.numel()}")
        self.lm_head = lm_head.to(device=device, dtype=dtype)
        self.draft_ids = (torch.arange(d2t.numel()) + d2t.to(torch.int64)).to(device)  # target id of each draft id
        self.t2d = t2d.to(device=device, dtype=torch.bool)
        self.k, self.chunk_tokens = k, chunk_tokens

    @torch.inference_mode()
    def __call__(self, last: torch.Tensor) -> dict[str, torch.Tensor]:
        n, device = last.shape[0], last.device
        ids = torch.empty((n, self.k), dtype=TOPK_ID_DTYPE, device=device)
        logprobs = torch.empty((n, self.k), dtype=TOPK_VALUE_DTYPE, device=device)
        in_draft = torch.empty(n, dtype=torch.uint8, device=device)
        for s in range(0, n, self.chunk_tokens):
            e = min(n, s + self.chunk_tokens)
            logits = (last[s:e].to(self.lm_head.dtype) @ self.lm_head.T).float()
            in_draft[s:e] = self.t2d[logits.argmax(-1)]
            values, draft = logits.index_select(1, self.draft_ids).topk(self.k, dim=-1)
            # fp16 holds log-probabilities down to -65504; below -1e4 a probability is 0 anyway
            logprobs[s:e] = (values - torch.logsumexp(logits, -1, keepdim=True)).clamp(min=-1e4)
            ids[s:e] = draft  # int64 -> uint16: draft ids < 65,536 (the layout's limit)
        return {"topk_ids": ids, "topk_logprobs": logprobs, "target_in_draft": in_draft}


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
    layout: SampleLayout | None = None,
    teacher: TopkTeacher | None = None,
) -> None:
    """Extract and write `samples` (row_id, input_ids, loss_mask) into shard_dir.

    `batch_tokens` is the size of one packed forward (a longer sample runs alone);
    `staging_buffers` host buffers of that size bound the memory: when the writers
    fall behind, the forward waits for a free buffer. `lean=None` uses the lean
    forward where the model supports it (`lean_supported`), False forces the
    Hugging Face forward (right-padded batches, hooks). `fsync=True` makes each file
    durable before its rename (the writers then wait on the disk, the forward does not
    until the staging buffers are all taken). `write=False` runs the same forwards and
    writes nothing: the other ranks of a tensor-parallel group, whose collectives must
    match rank 0's. `layout` says what the files store (None: the hidden states in `dtype` and
    the last hidden state); a "topk" layout needs `teacher`. `dtype` is the forward's dtype.
    """
    shard_dir = Path(shard_dir)
    if not samples:
        return
    use_lean = lean_supported(base_model) if lean is None else lean
    device = next(base_model.parameters()).device
    hidden = base_model.config.hidden_size
    layout = layout or SampleLayout(hidden, dtype, aux_layers=len(aux_layer_ids))
    lengths = [len(s[1]) for s in samples]
    if use_lean:
        packs = plan_packs(lengths, batch_tokens)
        capture = None
    else:
        packs = plan_padded_batches(lengths, batch_tokens)
        capture = LayerCapture(base_model, aux_layer_ids)
    capacity = max(sum(lengths[i] for i in p) for p in packs)
    staging = _Staging(max(1, staging_buffers), capacity, device)
    copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    futures: deque[Future] = deque()

    def reap(block: bool = False) -> None:
        while futures and (block or futures[0].done()):
            futures.popleft().result()  # raises a writer's error (e.g. disk full) here

    try:
        with ThreadPoolExecutor(max(1, writer_threads), thread_name_prefix="writer") as pool:
            for done, pack in enumerate(packs):
                if STOP.is_set():  # asked to stop: the packs written so far are kept (the pool finishes them)
                    raise Stopped(f"stopped after {done} of {len(packs)} packs; {sum(map(len, packs[:done]))} samples "
                                  f"written to {shard_dir.name} are kept")
                items = [samples[i] for i in pack]
                slot = staging.acquire(reap)
                if use_lean:
                    aux_dev, last_dev = lean_forward(base_model, [s[1] for s in items], aux_layer_ids, dtype)
                else:
                    aux_b, last_b = forward_batch(base_model, capture, [s[1] for s in items], device)
                    aux_dev, last_dev = _unpad(aux_b, items, dtype), _unpad(last_b, items, dtype)
                if not write:
                    staging.release(slot)
                    continue
                features = encode_features(aux_dev, last_dev, layout, teacher)  # on the device, before the copy
                del aux_dev, last_dev
                host, ready = staging.stage(slot, features, copy_stream)
                del features
                countdown = _Countdown(len(items), lambda slot=slot: staging.release(slot))
                off = 0
                for row_id, ids, mask in items:
                    t = len(ids)
                    futures.append(
                        pool.submit(
                            _write_staged, sample_file(shard_dir, row_id), ids, mask,
                            {key: v[off : off + t] for key, v in host.items()}, metadata, ready, countdown, fsync,
                        )
                    )
                    off += t
                reap()
            reap(block=True)
    finally:
        if capture is not None:
            capture.remove()


def warm_up(base_model, aux_layer_ids: list[int], dtype: torch.dtype, lean: bool | None = None, tokens: int = 256,
            layout: SampleLayout | None = None, teacher: TopkTeacher | None = None) -> None:
    """One short forward of two samples (and the layout's encoding) before the clock starts: the
    device's libraries and kernels load here, as part of the job's start, not inside the first
    timed pack."""
    vocab = base_model.config.vocab_size
    ids = [i % vocab for i in range(tokens)]
    if lean_supported(base_model) if lean is None else lean:
        aux, last = lean_forward(base_model, [ids, ids[: tokens // 2]], aux_layer_ids, dtype)
    else:
        capture = LayerCapture(base_model, aux_layer_ids)
        try:
            aux, last = forward_batch(base_model, capture, [ids], next(base_model.parameters()).device)
            aux, last = aux[0].to(dtype), last[0].to(dtype)
        finally:
            capture.remove()
    if layout is not None:
        encode_features(aux, last, layout, teacher)
    if next(base_model.parameters()).device.type == "cuda":
        torch.cuda.synchronize()


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


def plan_padded_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Sample indices, longest first, in right-padded batches of at most `batch_tokens` tokens
    counting the padding (rows x the first, longest row; a longer sample is a batch of its own).
    Sorted by length, a batch's rows differ little, so little of it is padding."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def _unpad(x: torch.Tensor, items, dtype: torch.dtype) -> torch.Tensor:
    """A right-padded batch [B, T, D] as the rows of its samples end to end [N, D] (a pack)."""
    if len(items) == 1:
        return x[0, : len(items[0][1])].to(dtype)
    return torch.cat([x[b, : len(s[1])] for b, s in enumerate(items)]).to(dtype)


def _write_staged(path, ids, mask, features, metadata, ready, countdown, fsync=False) -> None:
    try:
        if ready is not None:
            ready.synchronize()  # the device->host copy has landed (releases the GIL while waiting)
        write_sample(path, ids, mask, features, metadata, fsync)
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
    """A fixed number of host staging slots: pinned buffers of `capacity` tokens on CUDA, one per
    stored tensor (allocated on first use, reused after), plain tensors on the CPU. Taking a slot
    when none is free waits for the writers: that is the backpressure that bounds memory."""

    def __init__(self, n: int, capacity: int, device: torch.device):
        self.n, self.capacity = n, capacity
        self.pinned = device.type == "cuda"
        self.free: queue.Queue[int] = queue.Queue()
        for i in range(n):
            self.free.put(i)
        self.buffers: dict[tuple[int, str], torch.Tensor] = {}

    def acquire(self, poll) -> int:
        while True:
            try:
                return self.free.get(timeout=0.5)
            except queue.Empty:
                poll()  # a writer's error surfaces here instead of waiting forever

    def release(self, slot: int) -> None:
        self.free.put(slot)

    def stage(self, slot: int, tensors: dict[str, torch.Tensor], copy_stream):
        """Host copies of a pack's row-aligned tensors ([N, ...] each) and the event that marks
        them landed (None on the CPU, where the tensors are already on the host)."""
        if not self.pinned:
            return tensors, None
        device = next(iter(tensors.values())).device
        produced = torch.cuda.current_stream(device).record_event()
        copy_stream.wait_event(produced)
        host = {}
        with torch.cuda.stream(copy_stream):
            for key, t in tensors.items():
                buf = self.buffers.get((slot, key))
                if buf is None or buf.dtype != t.dtype or buf.shape[1:] != t.shape[1:]:
                    buf = self.buffers[(slot, key)] = torch.empty(
                        (self.capacity, *t.shape[1:]), dtype=t.dtype, pin_memory=True)
                host[key] = buf[: t.shape[0]]
                host[key].copy_(t, non_blocking=True)
            ready = copy_stream.record_event()
        for t in tensors.values():
            t.record_stream(copy_stream)  # the allocator keeps them until the copy is done
        return host, ready
