"""The batches: packed rows (or length-bucketed, right-padded batches), planned per epoch from the
sample refs and streamed from disk or from samples preloaded onto the device."""

from __future__ import annotations

import math
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import torch

from ..distributed import Dist
from ..sample_files import SampleRef, dequantize_features, read_sample_slices
from .job import TrainConfig
from .loss import counted_rows

# Batch keys that stay on the host: each sample's length, and the rows that go through the head.
META = ("lengths", "head_rows")


def plan_epoch(refs: list[SampleRef], batch_tokens: int, max_length: int | None, rng: random.Random,
               packed: bool = False) -> list[list[SampleRef]]:
    """Shuffle, then sort within pools of ~64 batches by length and cut batches whose padded
    size (count * longest) stays within batch_tokens; the batch order is shuffled again.
    Sorting only within a pool keeps batches similar in length without a fixed order.
    `packed`: batches are cut from the shuffled order by real tokens (a packed row has no
    padding, so lengths need not be alike)."""
    order = refs[:]
    rng.shuffle(order)
    if packed:
        batches, batch, tokens = [], [], 0
        for ref in order:
            length = _capped(ref.tokens, max_length)
            if batch and tokens + length > batch_tokens:
                batches.append(batch)
                batch, tokens = [], 0
            batch.append(ref)
            tokens += length
        return batches + ([batch] if batch else [])
    mean_len = sum(_capped(r.tokens, max_length) for r in refs) / len(refs)
    pool_size = max(1, int(64 * batch_tokens / max(mean_len, 1)))
    batches = []
    for start in range(0, len(order), pool_size):
        pool = sorted(order[start : start + pool_size], key=lambda r: r.tokens)
        batch, longest = [], 0
        for ref in pool:
            length = _capped(ref.tokens, max_length)
            if batch and max(longest, length) * (len(batch) + 1) > batch_tokens:
                batches.append(batch)
                batch, longest = [], 0
            batch.append(ref)
            longest = max(longest, length)
        if batch:
            batches.append(batch)
    rng.shuffle(batches)
    return batches


def _capped(tokens: int, max_length: int | None) -> int:
    return tokens if max_length is None else min(tokens, max_length)


def load_batch(batch: list[SampleRef], max_length: int | None, packed: bool = False) -> dict[str, torch.Tensor]:
    """Read a batch from disk (as stored: fp8 stays fp8 until the device) and right-pad it, or
    pack it into one row; `lengths` gives each sample's true length."""
    samples = [read_sample_slices(ref.path, max_length, dequantize=False) for ref in batch]
    return pack_batch(samples) if packed else pad_batch(samples)


def batches_forever(
    refs, cfg: TrainConfig, cache: dict | None = None, start_step: int = 0, rank: int = 0, world: int = 1,
    head_rows: dict | None = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """Endless batches, epoch after epoch. With `cache` (see `preload_samples`) batches are
    padded from the in-memory samples; the plan is the same as from disk. `head_rows`
    (`head_row_counts`): packed batches carry their sum.

    One plan for all ranks: step s of rank r is batch s * world + r, so DDP ranks see different
    batches, and a resumed run skips the batches it already trained on (planning reads no file)."""
    rng = random.Random(cfg.seed)
    index = 0
    packed = cfg.attention != "padded"
    while True:
        for batch in plan_epoch(refs, cfg.batch_tokens, cfg.max_length, rng, packed):
            if index >= start_step * world and index % world == rank:
                yield (load_batch(batch, cfg.max_length, packed) if cache is None
                       else _batch_from_cache(batch, cache, packed, head_rows))
            index += 1


def preload_samples(refs: list[SampleRef], max_length: int | None, device: torch.device, workers: int = 8) -> dict:
    """Read every sample once (truncated to max_length, as stored) onto `device`: path -> tensors.
    Several threads: one reads a file while another's copy to the device runs (both release the
    GIL), where one thread did them in turn (12.6 s for the preset's 18.8 GB on an H100 node)."""
    def load(ref: SampleRef):
        return ref.path, {k: v.to(device) for k, v in read_sample_slices(ref.path, max_length, dequantize=False).items()}

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(pool.map(load, refs))


@torch.no_grad()
def add_target_in_draft(cache: dict, lm_head: torch.Tensor, t2d: torch.Tensor, chunk_tokens: int = 4096) -> None:
    """Each preloaded sample's `target_in_draft` (is the target's argmax over its full vocabulary
    a draft token?), made once here where every step made it again for every epoch: a product
    with the whole lm_head and its argmax (on an H100 about 3 ms of the preset's 63 ms step).
    `packed_teacher` takes it from the batch; the top-k layout stores it in its files."""
    for sample in cache.values():
        if "last_hidden_state" not in sample or "target_in_draft" in sample:
            continue
        h = dequantize_features(sample)["last_hidden_state"].to(lm_head.dtype)  # as packed_teacher casts it
        sample["target_in_draft"] = torch.cat([t2d[(h[a : a + chunk_tokens] @ lm_head.T).argmax(-1)]
                                               for a in range(0, h.shape[0], chunk_tokens)])


@torch.no_grad()
def head_row_counts(cache: dict, steps: int) -> dict:
    """path -> how many of the preloaded sample's rows count at some TTT step (`counted_rows`):
    the rows that go through the head. All samples at once, as one packed row: one read-back."""
    masks = [sample["loss_mask"] for sample in cache.values()]
    lengths = torch.tensor([m.shape[0] for m in masks], device=masks[0].device)
    ends = torch.cumsum(lengths, 0)
    union = torch.stack(counted_rows(torch.cat(masks), torch.repeat_interleave(ends, lengths), steps)).any(0)
    upto = torch.cat((union.new_zeros(1, dtype=torch.int64), torch.cumsum(union, 0)))
    return dict(zip(cache, (upto[ends] - upto[ends - lengths]).tolist()))


def _batch_from_cache(batch: list[SampleRef], cache: dict, packed: bool = False,
                      head_rows: dict | None = None) -> dict[str, torch.Tensor]:
    samples = [cache[ref.path] for ref in batch]
    if not packed:
        return pad_batch(samples)
    out = pack_batch(samples)
    if head_rows is not None:
        out["head_rows"] = torch.tensor(sum(head_rows[ref.path] for ref in batch))
    return out


def pack_batch(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Concatenate samples into one row ([N, ...], no padding) on their device; `lengths` (on
    the CPU) gives each sample's length, from which the bounds and positions are made."""
    as_index = {"input_ids", "loss_mask", "topk_ids"}
    out = {key: torch.cat([s[key] for s in samples]) for key in samples[0]}
    out = {key: v.long() if key in as_index else v for key, v in out.items()}
    out["lengths"] = torch.tensor([s["input_ids"].shape[0] for s in samples])
    return out


def pad_batch(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad samples into one batch on their device; `lengths` gives each sample's true length."""
    T = max(s["input_ids"].shape[0] for s in samples)
    device = samples[0]["input_ids"].device

    def pad(key: str, dtype: torch.dtype) -> torch.Tensor:
        out = torch.zeros((len(samples), T, *samples[0][key].shape[1:]), dtype=dtype, device=device)
        for i, s in enumerate(samples):
            out[i, : s[key].shape[0]] = s[key].to(dtype)
        return out

    # Ids become int64 (indices); every other tensor keeps its stored dtype (fp8 and its scales
    # included: padding is zeros, which dequantize to zeros).
    as_index = {"input_ids", "loss_mask", "topk_ids"}
    out = {key: pad(key, torch.int64 if key in as_index else samples[0][key].dtype) for key in samples[0]}
    out["lengths"] = torch.tensor([s["input_ids"].shape[0] for s in samples])
    return out


def plan_steps(cfg: TrainConfig, refs: list[SampleRef], world: int) -> tuple[int, int]:
    """(batches per epoch, optimizer steps): `max_steps`, else `epochs` passes over the data."""
    packed = cfg.attention != "padded"
    batches = len(plan_epoch(refs, cfg.batch_tokens, cfg.max_length, random.Random(cfg.seed), packed))
    return batches, cfg.max_steps or max(1, math.ceil(cfg.epochs * batches / world))


def build_data(refs: list[SampleRef], cfg: TrainConfig, dist: Dist, start_step: int, log,
               teacher_head: tuple[torch.Tensor, torch.Tensor] | None = None):
    """(the batch stream of this rank from `start_step`, preload seconds, `head_row_counts` or
    None); samples preloaded onto the device when `preload` says so (None: on CUDA when they take
    under half of the free memory), with their `target_in_draft` made once from `teacher_head`
    (the target's lm_head, t2d)."""
    preload = cfg.preload
    if preload is None:
        preload = dist.device.type == "cuda" and (
            sum(r.path.stat().st_size for r in refs) < 0.5 * torch.cuda.mem_get_info(dist.device)[0])
    cache, preload_s, counts = None, 0.0, None
    if preload:
        t0 = time.perf_counter()
        cache = preload_samples(refs, cfg.max_length, dist.device)
        if teacher_head is not None:
            add_target_in_draft(cache, *teacher_head)
        if cfg.attention != "padded":
            counts = head_row_counts(cache, cfg.ttt_steps)
        preload_s = time.perf_counter() - t0
        log(f"train: preloaded {len(cache)} samples onto {dist.device} in {preload_s:.1f} s"
            + (f"; {sum(counts.values()):,} of their {sum(r.tokens for r in refs):,} rows go through the head"
               if counts else ""))
    return batches_forever(refs, cfg, cache, start_step, dist.rank, dist.world, counts), preload_s, counts
