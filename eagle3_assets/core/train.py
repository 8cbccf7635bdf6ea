"""Train the EAGLE-3 drafter on extracted hidden states (nanoGPT-style: the loop is the code).

Inputs: shard directories in the hidden-state file contract (`sample_files.py`), the target's
folder (its embeddings and lm_head only), and the vocab map. Output: an official EAGLE-3
checkpoint. `train_drafter` reads as a table of contents: set up, build the model, the data
and the optimizer, restore a saved state, then the loop, each step one call to a named helper.

The loss is the official `traineagle3` one: at TTT step k the drafter's distribution at index
t is fitted (soft cross-entropy) to the target's distribution over the draft vocabulary at
position t+k+1, i.e. for token t+k+2; positions whose target argmax is outside the draft
vocabulary are masked; total = sum_k loss_decay^k * loss_k. The target's distribution comes
from whichever teacher the files hold (`teacher_distribution`): softmax(lm_head(last hidden
state)) over the draft vocabulary, or the stored top-k renormalized over its k ids. fp8 files
are moved as stored and dequantized on the training device.

A batch is one packed row of samples (`pack_batch`, `training.attention` auto/flash/math): the
TTT attention merges FlashAttention's causal prefix with each position's own keys through
log-sum-exp (`drafter.TTTAttention`) and the LM head + loss run in chunks of tokens
(`ChunkedSoftCrossEntropy`), so neither a score matrix nor [tokens, vocab] float32 tensors
exist whole; in float32 it computes the first, padded implementation's loss and gradients
(`attention: padded`, kept as the reference; eagle3_assets_tests/test_train_fast.py).

Training is resumable: the full state (weights, optimizer, step, curve, training time so far)
is saved every `save_every` steps and when a run is stopped on purpose (SIGTERM, or
`TrainJob.stop_after_s` for a time-limited slot); the next run with the same data and config
continues it, and `time_budget_s` counts the training time of all the runs, so the LR schedule
spans them.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import signal
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Callable, Iterator, Literal

from annotated_types import Ge, Le

import torch
from safetensors import safe_open

from .config import STRICT, Fraction, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt
from .distributed import Dist, setup
from . import drafter as drafter_module
from .drafter import DrafterConfig, Eagle3Drafter, save_checkpoint
from .files import atomic_path
from .sample_files import DamagedSampleError, SampleRef, dequantize_features, list_samples, read_sample_slices
from .stopping import STOP
from .target import load_target_head
from .vocab import load_vocab_map


@dataclass(frozen=True)
class TrainConfig:
    """The `training:` section of the settings."""

    __pydantic_config__ = STRICT
    ttt_steps: PositiveInt = 7  # unrolled training-time-test steps (the official code and SpecForge: 7)
    loss_decay: Fraction = 0.8  # step k's loss weighs loss_decay**k
    lr: PositiveFloat = 1e-4
    min_lr_ratio: Annotated[float, Ge(0), Le(1)] = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: NonNegativeInt = 100
    epochs: PositiveFloat = 1.0  # passes over the data, unless max_steps is set
    max_steps: PositiveInt | None = None  # optimizer steps; None: epochs x batches per epoch
    # Training seconds in all (over every run of a resumed training); the cosine schedule ends
    # fully decayed at whichever of max_steps and the budget comes first.
    time_budget_s: PositiveFloat | None = None
    # Tokens per batch and rank: real tokens of one packed row, or with attention "padded" the
    # padded size B * T_max.
    batch_tokens: PositiveInt = 8192
    grad_clip: PositiveFloat = 0.5
    weight_decay: NonNegativeFloat = 0.0
    seed: int = 0
    max_length: Annotated[int, Ge(2)] | None = None  # longer samples are truncated; None keeps them whole
    device: str = "auto"
    nproc: PositiveInt = 1  # > 1: DDP over that many processes (torchrun)
    # Keep every sample in device memory after one read instead of reading each batch from
    # disk; None: on CUDA when the sample files take less than half of the free memory.
    preload: bool | None = None
    save_every: PositiveInt = 50  # steps between saved states (a killed run resumes from the last)
    log_every: PositiveInt = 10
    acc_window: PositiveInt = 50  # per-step accuracy is measured over the last this many batches
    checkpoint_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    # How a batch is trained: samples packed into one row, TTT attention without a score matrix
    # ("flash": FlashAttention varlen, CUDA; "math": per sample in float32, the reference) and a
    # chunked LM head + loss; "auto": flash on CUDA, math elsewhere. "padded": the first
    # implementation (right-padded rows, the full score matrix, [B, T, V] logits per step).
    attention: Literal["auto", "flash", "math", "padded"] = "auto"
    loss_chunk_tokens: PositiveInt = 4096  # tokens per chunk of the fused LM head + loss
    # torch.compile the loss's per-chunk math on CUDA (one fused pass over each chunk's logits);
    # off: eager kernels, several passes.
    compile: bool = False
    # Capture the whole training step (forward, loss, backward, clip, AdamW) in one CUDA graph
    # and replay it per batch: rows padded to exactly batch_tokens, fixed shapes, no host sync.
    # CUDA with the flash attention only; one process.
    cuda_graph: bool = False
    # Training seconds (over all runs) at which a copy of the drafter is written to
    # <out_dir>/snapshots/t<seconds>/, for tau against training time.
    snapshot_at_s: list[PositiveFloat] = field(default_factory=list)


@dataclass(frozen=True)
class TrainJob:
    """One training run: what it reads and writes, and its config."""

    shard_dirs: list[str]
    target_model_dir: str
    vocab_map_path: str
    out_dir: str
    aux_layer_ids: list[int]
    draft_vocab_size: int
    config: TrainConfig = field(default_factory=TrainConfig)
    state_path: str | None = None  # where the resumable state lives; None: not resumable
    # Pause this run after this many seconds of its own and keep the state (a time-limited slot).
    stop_after_s: float | None = None


# ---------------------------------------------------------------------------------------------
# Data: packed rows (or length-bucketed, right-padded batches), streamed from disk or from
# preloaded samples
# ---------------------------------------------------------------------------------------------


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
    refs, cfg: TrainConfig, cache: dict | None = None, start_step: int = 0, rank: int = 0, world: int = 1
) -> Iterator[dict[str, torch.Tensor]]:
    """Endless batches, epoch after epoch. With `cache` (see `preload_samples`) batches are
    padded from the in-memory samples; the plan is the same as from disk.

    One plan for all ranks: step s of rank r is batch s * world + r, so DDP ranks see different
    batches, and a resumed run skips the batches it already trained on (planning reads no file)."""
    rng = random.Random(cfg.seed)
    index = 0
    packed = cfg.attention != "padded"
    while True:
        for batch in plan_epoch(refs, cfg.batch_tokens, cfg.max_length, rng, packed):
            if index >= start_step * world and index % world == rank:
                yield (load_batch(batch, cfg.max_length, packed) if cache is None
                       else _batch_from_cache(batch, cache, packed))
            index += 1


def preload_samples(refs: list[SampleRef], max_length: int | None, device: torch.device) -> dict:
    """Read every sample once (truncated to max_length, as stored) onto `device`: path -> tensors."""
    return {ref.path: {k: v.to(device) for k, v in read_sample_slices(ref.path, max_length, dequantize=False).items()}
            for ref in refs}


def _batch_from_cache(batch: list[SampleRef], cache: dict, packed: bool = False) -> dict[str, torch.Tensor]:
    samples = [cache[ref.path] for ref in batch]
    return pack_batch(samples) if packed else pad_batch(samples)


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


# ---------------------------------------------------------------------------------------------
# Loss
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def target_distribution(
    last_hidden_state: torch.Tensor, lm_head: torch.Tensor, t2d: torch.Tensor, chunk_tokens: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's next-token distribution over the draft vocabulary, p = softmax(logits[t2d])
    (float32, [B, T, draft_vocab]), and whether its argmax over the full vocabulary is a draft
    token ([B, T] bool). Computed in chunks so the full-vocabulary logits never exist at once."""
    B, T, H = last_hidden_state.shape
    flat = last_hidden_state.reshape(B * T, H).to(lm_head.dtype)
    draft_head = lm_head[t2d]
    probs, in_draft = [], []
    for start in range(0, B * T, chunk_tokens):
        h = flat[start : start + chunk_tokens]
        in_draft.append(t2d[(h @ lm_head.T).argmax(-1)])
        probs.append(torch.softmax((h @ draft_head.T).float(), dim=-1))
    return torch.cat(probs).view(B, T, -1), torch.cat(in_draft).view(B, T)


@torch.no_grad()
def topk_distribution(topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """The stored top-k teacher as a distribution over the draft vocabulary ([B, T, draft_vocab],
    float32): softmax of the k log-probabilities (renormalized over the k ids), zero elsewhere."""
    p = torch.zeros((*topk_ids.shape[:-1], draft_vocab_size), dtype=torch.float32, device=topk_ids.device)
    return p.scatter_(-1, topk_ids.long(), torch.softmax(topk_logprobs.float(), dim=-1))


def teacher_distribution(
    batch: dict[str, torch.Tensor], lm_head: torch.Tensor, t2d: torch.Tensor, draft_vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(p over the draft vocabulary, whether the target's full-vocabulary argmax is a draft token)
    from whichever teacher the batch holds: the last hidden state, or the stored top-k with
    its recorded argmax flag. One loss (`ttt_loss`) trains on either."""
    if "last_hidden_state" in batch:
        return target_distribution(batch["last_hidden_state"], lm_head, t2d)
    if "topk_ids" in batch:
        return (topk_distribution(batch["topk_ids"], batch["topk_logprobs"], draft_vocab_size),
                batch["target_in_draft"].bool())
    raise KeyError(f"the batch holds no teacher (last_hidden_state or topk_ids): keys {sorted(batch)}")


def ttt_loss(
    step_logits: list[torch.Tensor],
    target_p: torch.Tensor,
    target_in_draft: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_decay: float,
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Weighted TTT loss, the per-step losses and per-step top-1 tallies [steps, 2] (correct,
    counted), left on the device so that a training step needs no GPU-to-CPU sync.

    Step k at index t imitates the target at position s = t+k+1 (which predicts token
    t+k+2). A position counts when that token is an answer token, loss_mask[t+k+2] == 1 (the
    official code reaches the same alignment by starting its loss mask two tokens before the
    answer; right padding is loss_mask 0, so padding never counts). It enters the loss only
    when the target's argmax is in the draft vocabulary; accuracy counts those others as
    misses. Each step's loss is the soft cross-entropy averaged over its counted positions.
    """
    T = loss_mask.shape[1]
    total = torch.zeros((), device=target_p.device)
    target_argmax = target_p.argmax(-1)  # once, not per step: it is a pass over [B, T, V]
    losses, tallies = [], []
    for k, logits in enumerate(step_logits):
        s = k + 1
        n = T - s - 1  # indices t whose token t+s+1 exists in the padded batch
        if n <= 0:
            losses.append(total.new_zeros(()))
            tallies.append(torch.zeros(2, dtype=torch.int64, device=total.device))
            continue
        counted = loss_mask[:, s + 1 :].bool()  # [B, n]
        in_draft = target_in_draft[:, s : s + n]
        p = target_p[:, s : s + n]
        z = logits[:, :n].float()
        # -sum(p * log_softmax(z)) = logsumexp(z) - sum(p * z), as p sums to 1; this skips a
        # [B, n, V] log-softmax tensor, which at 16k tokens x 16k-32k vocab is the step's
        # largest memory traffic.
        per_position = torch.logsumexp(z, dim=-1) - (p * z).sum(-1)
        loss = (per_position * (counted & in_draft)).sum() / counted.sum().clamp(min=1)
        total = total + loss_decay**k * loss
        losses.append(loss.detach())
        with torch.no_grad():
            correct = (z.argmax(-1) == target_argmax[:, s : s + n]) & counted & in_draft
            tallies.append(torch.stack((correct.sum(), counted.sum())))
    return total, losses, torch.stack(tallies)


# ---------------------------------------------------------------------------------------------
# Loss on a packed row: a fused, chunked LM head + soft cross-entropy
# ---------------------------------------------------------------------------------------------


class PackedTeacher:
    """The target's distribution over the draft vocabulary on a packed row, kept compact: the
    draft-vocabulary logits [N, V] in the head's dtype (as the padded path computes them before
    its float32 softmax) with their log-sum-exp, or the stored top-k; `rows_of` gives some of
    its rows. `in_draft` [N]: whether the target's full-vocabulary argmax is a draft token;
    `argmax` [N]: the teacher's own argmax over the draft vocabulary (for accuracy)."""

    def __init__(self, in_draft: torch.Tensor, argmax: torch.Tensor, logits: torch.Tensor | None = None,
                 topk: tuple[torch.Tensor, torch.Tensor] | None = None, draft_vocab_size: int = 0):
        self.in_draft, self.argmax, self.logits, self.topk = in_draft, argmax, logits, topk
        self.draft_vocab_size = draft_vocab_size
        self.lse = None if logits is None else _logsumexp_rows(logits)
        self.rows = in_draft.shape[0]

    def rows_of(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows `index` as (logits, their log-sum-exp), or (float32 probabilities, None)
        for the top-k teacher."""
        if self.logits is not None:
            return self.logits.index_select(0, index), self.lse.index_select(0, index)
        ids, logprobs = self.topk
        return topk_distribution(ids.index_select(0, index), logprobs.index_select(0, index),
                                 self.draft_vocab_size), None


def _logsumexp_rows(logits: torch.Tensor, chunk_tokens: int = 4096) -> torch.Tensor:
    return torch.cat([torch.logsumexp(logits[s : s + chunk_tokens].float(), dim=-1)
                      for s in range(0, logits.shape[0], chunk_tokens)])


@torch.no_grad()
def packed_teacher(batch: dict[str, torch.Tensor], lm_head: torch.Tensor, t2d: torch.Tensor, draft_vocab_size: int,
                   chunk_tokens: int = 4096, draft_head: torch.Tensor | None = None) -> PackedTeacher:
    """`teacher_distribution` for a packed row (batch tensors [N, ...]), without the float32 [N, V].
    `draft_head`: lm_head[t2d], made beforehand (a CUDA graph cannot make it: its size is data)."""
    if "last_hidden_state" in batch:
        flat = batch["last_hidden_state"].to(lm_head.dtype)
        draft_head = lm_head[t2d] if draft_head is None else draft_head
        logits, in_draft = [], []
        for start in range(0, flat.shape[0], chunk_tokens):
            h = flat[start : start + chunk_tokens]
            in_draft.append(t2d[(h @ lm_head.T).argmax(-1)])
            logits.append(h @ draft_head.T)
        logits = torch.cat(logits)
        return PackedTeacher(torch.cat(in_draft), logits.argmax(-1), logits=logits)
    if "topk_ids" in batch:
        ids, logprobs = batch["topk_ids"], batch["topk_logprobs"]
        # the dense distribution's argmax: the first of the ids with the largest probability
        best = torch.softmax(logprobs.float(), dim=-1)
        top = best.max(-1, keepdim=True).values
        argmax = torch.where(best == top, ids, draft_vocab_size).min(-1).values
        return PackedTeacher(batch["target_in_draft"].bool(), argmax, topk=(ids, logprobs),
                             draft_vocab_size=draft_vocab_size)
    raise KeyError(f"the batch holds no teacher (last_hidden_state or topk_ids): keys {sorted(batch)}")


# The per-chunk math of the loss, as plain functions of a chunk's logits z (the head's dtype)
# and the teacher's chunk (logits t with lse_t, or probabilities p), so that `training.compile`
# can fuse each into a kernel or two that read z and t once.
def _ce_forward_logits(z, t, lse_t):
    """(logsumexp(z), sum(p * z), argmax z) per row, p = exp(t - lse_t)."""
    z = z.float()
    return torch.logsumexp(z, dim=-1), (torch.exp(t.float() - lse_t[:, None]) * z).sum(-1), z.argmax(-1)


def _ce_forward_probs(z, p):
    z = z.float()
    return torch.logsumexp(z, dim=-1), (p * z).sum(-1), z.argmax(-1)


def _ce_grad_logits(z, lse, t, lse_t, w):
    """d loss / d z = (softmax(z) - p) * w, in z's dtype."""
    return ((torch.exp(z.float() - lse[:, None]) - torch.exp(t.float() - lse_t[:, None])) * w[:, None]).to(z.dtype)


def _ce_grad_probs(z, lse, p, w):
    return ((torch.exp(z.float() - lse[:, None]) - p) * w[:, None]).to(z.dtype)


_CE_EAGER = (_ce_forward_logits, _ce_forward_probs, _ce_grad_logits, _ce_grad_probs)
_ce_compiled: tuple | None = None


def _ce_functions(compiled: bool) -> tuple:
    global _ce_compiled
    if not compiled:
        return _CE_EAGER
    if _ce_compiled is None:  # dynamic: the last chunk of a row has another length
        _ce_compiled = tuple(torch.compile(f, dynamic=True) for f in _CE_EAGER)
    return _ce_compiled


class ChunkedSoftCrossEntropy(torch.autograd.Function):
    """sum_t w_t * (logsumexp(z_t) - sum(p_t * z_t)) with z_t = hidden_t @ weight.T, one chunk
    of rows at a time, so the [N, V] float32 logits, softmax and gradient never exist whole
    (-sum(p * log_softmax(z)) = logsumexp(z) - sum(p * z), as p sums to 1). Row t is fitted to
    the teacher's row teacher_rows[t]. Backward recomputes each chunk's logits: dz = (softmax(z) - p)
    * w, dhidden = dz @ weight, dweight = sum over chunks of dz.T @ hidden. Also returns,
    without gradient, each row's argmax z (for accuracy)."""

    @staticmethod
    def forward(ctx, hidden, weight, row_weights, teacher: PackedTeacher, teacher_rows, chunk: int, compiled: bool):
        fwd_logits, fwd_probs, _, _ = _ce_functions(compiled)
        N = hidden.shape[0]
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        lse = torch.empty(N, dtype=torch.float32, device=hidden.device)
        argmax = torch.empty(N, dtype=torch.int64, device=hidden.device)
        for a in range(0, N, chunk):
            b = min(a + chunk, N)
            z = hidden[a:b] @ weight.T
            t, lse_t = teacher.rows_of(teacher_rows[a:b])
            lse[a:b], pz, argmax[a:b] = fwd_logits(z, t, lse_t) if lse_t is not None else fwd_probs(z, t)
            loss = loss + (row_weights[a:b] * (lse[a:b] - pz)).sum()
        ctx.save_for_backward(hidden, weight, row_weights, lse, teacher_rows)
        ctx.teacher, ctx.chunk, ctx.compiled = teacher, chunk, compiled
        ctx.mark_non_differentiable(argmax)
        return loss, argmax

    @staticmethod
    def backward(ctx, grad_loss, _grad_argmax):
        _, _, grad_logits, grad_probs = _ce_functions(ctx.compiled)
        hidden, weight, row_weights, lse, teacher_rows = ctx.saved_tensors
        N = hidden.shape[0]
        d_hidden = torch.empty_like(hidden)
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for a in range(0, N, ctx.chunk):
            b = min(a + ctx.chunk, N)
            z = hidden[a:b] @ weight.T
            t, lse_t = ctx.teacher.rows_of(teacher_rows[a:b])
            w = row_weights[a:b] * grad_loss
            dz = grad_logits(z, lse[a:b], t, lse_t, w) if lse_t is not None else grad_probs(z, lse[a:b], t, w)
            d_hidden[a:b] = dz @ weight
            d_weight += (dz.T @ hidden[a:b]).float()
        return d_hidden, d_weight.to(weight.dtype), None, None, None, None, None


def packed_ttt_loss(
    step_hidden: list[torch.Tensor],
    model: Eagle3Drafter,
    teacher: PackedTeacher,
    loss_mask: torch.Tensor,
    sample_end: torch.Tensor,
    loss_decay: float,
    chunk_tokens: int = 4096,
    compute_dtype: torch.dtype = torch.float32,
    compiled: bool = False,
    all_rows: bool = False,
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """`ttt_loss` on a packed row, from each step's layer output [N, H] (pre-norm).

    Step k at index t imitates the teacher at t+k+1, counted when token t+k+2 is an answer
    token (loss_mask) AND lies in t's own sample (t+k+2 < sample_end[t]): the shifts run over
    the whole row, and this mask is what keeps the next sample out (see
    `Eagle3Drafter.ttt_forward_packed`). With the samples of a padded batch this is the padded
    loss: the same positions, each averaged over the same count."""
    N = loss_mask.shape[0]
    index = torch.arange(N, device=loss_mask.device)
    counted, included = [], []
    for k in range(len(step_hidden)):
        s = k + 1
        c = torch.zeros(N, dtype=torch.bool, device=loss_mask.device)
        c[: max(N - s - 1, 0)] = loss_mask[s + 1 :].bool()
        c &= index + s + 1 < sample_end
        i = c.clone()
        i[: max(N - s, 0)] &= teacher.in_draft[s:]
        counted.append(c)
        included.append(i)
    # Only rows that count at some step go through the head: prompt tokens (often a third of a
    # row) never do. One read-back per batch, for the row count.
    rows = index if all_rows else torch.stack(counted).any(0).nonzero().squeeze(1)
    total = torch.zeros((), device=loss_mask.device)
    weight = model.lm_head.weight.to(compute_dtype)
    losses, tallies = [], []
    for k, hidden in enumerate(step_hidden):
        s = k + 1
        count = counted[k].sum()
        include = included[k] if all_rows else included[k].index_select(0, rows)
        teacher_rows = (rows + s).clamp(max=N - 1)  # rows past the end are not included
        hidden_rows = model.norm(hidden if all_rows else hidden.index_select(0, rows)).to(compute_dtype)
        loss, argmax = ChunkedSoftCrossEntropy.apply(hidden_rows, weight, include.float() / count.clamp(min=1),
                                                     teacher, teacher_rows, chunk_tokens, compiled)
        total = total + loss_decay**k * loss
        losses.append(loss.detach())
        agree = argmax == teacher.argmax.index_select(0, teacher_rows)
        tallies.append(torch.stack(((agree & include).sum(), count)))
    return total, losses, torch.stack(tallies)


def window_accuracy(window) -> list[float]:
    """Per-step top-1 accuracy over a window of [steps, 2] tallies (summed, then divided)."""
    if not window:
        return []
    total = torch.stack(list(window)).sum(0).tolist()
    return [correct / max(counted, 1) for correct, counted in total]


# ---------------------------------------------------------------------------------------------
# Schedule and stopping
# ---------------------------------------------------------------------------------------------


def learning_rate(step: int, cfg: TrainConfig, max_steps: int | None = None, time_fraction: float = 0.0) -> float:
    """Linear warm-up, then cosine decay to lr * min_lr_ratio at max_steps (nanoGPT's get_lr).
    `time_fraction` (training time / time budget) ends the decay early when time runs out first."""
    max_steps = max_steps or cfg.max_steps or 1
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps)
    progress = max(progress, time_fraction)
    coeff = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + coeff * (1.0 - cfg.min_lr_ratio))


class StopClock:
    """Answers "stop now, and why?" for every rank, from rank 0's clock.

    - "time_budget": the training time of all runs reached `time_budget_s`; the schedule is
      complete, so training is finished;
    - "paused": this run was asked to stop (SIGTERM, or `stop_after_s` of its own time): the
      state is kept for the next run.
    With several ranks the clock and the stop request are read from rank 0 every `log_every`
    steps (a broadcast waits for the GPU); one rank stopping alone would hang the others in
    the gradient all-reduce.
    """

    def __init__(self, cfg: TrainConfig, dist: Dist, trained_before_s: float, stop_after_s: float | None):
        self.cfg, self.dist, self.stop_after_s = cfg, dist, stop_after_s
        self.run_start = time.perf_counter()
        self.start = self.run_start - trained_before_s  # training time counts over resumed runs
        self.stop_requested = threading.Event()
        self._trained_s = trained_before_s
        self._run_s = 0.0
        self._requested = False

    @property
    def trained_s(self) -> float:
        return time.perf_counter() - self.start

    def time_fraction(self) -> float:
        return self._trained_s / self.cfg.time_budget_s if self.cfg.time_budget_s else 0.0

    def check(self, step: int, first_step: int) -> str | None:
        if self.dist.world == 1 or (step - first_step) % self.cfg.log_every == 0:
            now = time.perf_counter()
            self._trained_s, self._run_s, requested = self.dist.from_rank0(
                [now - self.start, now - self.run_start, float(self.stop_requested.is_set())])
            self._requested = bool(requested)
        if self.time_fraction() >= 1.0:
            return "time_budget"
        if step > first_step and (self._requested or (self.stop_after_s is not None and self._run_s >= self.stop_after_s)):
            return "paused"  # never before the run's first step: every run makes progress
        return None


def _stop_on_sigterm(clock: StopClock) -> dict:
    """SIGTERM (a preempted or time-limited job, `eagle3 run` stopped) or SIGINT (Ctrl-C) stops
    at the next step with the state saved; returns the previous handlers, to restore."""
    if STOP.is_set():  # asked while the job was setting up (the job's handler, `stopping.stop_on_signals`)
        clock.stop_requested.set()
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, lambda signum, frame: clock.stop_requested.set())
            for sig in (signal.SIGTERM, signal.SIGINT)}
# ---------------------------------------------------------------------------------------------
# The run, one named step at a time
# ---------------------------------------------------------------------------------------------


def build_draft_model(job: TrainJob, device: torch.device) -> tuple[Eagle3Drafter, torch.Tensor]:
    """The drafter (frozen target embeddings, the vocab map set) and the target's lm_head, on `device`."""
    from transformers import AutoConfig

    d2t, t2d = load_vocab_map(job.vocab_map_path)
    if d2t.numel() != job.draft_vocab_size:
        raise ValueError(f"vocab map {job.vocab_map_path} has {d2t.numel()} draft tokens, "
                         f"expected draft_vocab_size={job.draft_vocab_size}")
    embed, lm_head, _ = load_target_head(job.target_model_dir)
    config = DrafterConfig.from_target_config(AutoConfig.from_pretrained(job.target_model_dir), job.draft_vocab_size,
                                              job.aux_layer_ids)
    return place_draft_model(config, embed, lm_head, d2t, t2d, device)


def place_draft_model(config: DrafterConfig, embed: torch.Tensor, lm_head: torch.Tensor, d2t: torch.Tensor,
                      t2d: torch.Tensor, device: torch.device) -> tuple[Eagle3Drafter, torch.Tensor]:
    """The drafter of `config` on `device` as training runs it (also benchmarks/train_throughput.py)."""
    model = Eagle3Drafter(config, embed)
    model.set_vocab_map(d2t, t2d)
    model.to(device)
    low = torch.bfloat16 if device.type == "cuda" else torch.float32  # frozen tensors: no master copy needed
    model.embed_tokens = model.embed_tokens.to(low)
    return model, lm_head.to(device=device, dtype=low)


def plan_steps(cfg: TrainConfig, refs: list[SampleRef], world: int) -> tuple[int, int]:
    """(batches per epoch, optimizer steps): `max_steps`, else `epochs` passes over the data."""
    packed = cfg.attention != "padded"
    batches = len(plan_epoch(refs, cfg.batch_tokens, cfg.max_length, random.Random(cfg.seed), packed))
    return batches, cfg.max_steps or max(1, math.ceil(cfg.epochs * batches / world))


def build_data(refs: list[SampleRef], cfg: TrainConfig, dist: Dist, start_step: int, log):
    """The batch stream of this rank from `start_step`; samples preloaded onto the device when
    `preload` says so (None: on CUDA when they take under half of the free memory)."""
    preload = cfg.preload
    if preload is None:
        preload = dist.device.type == "cuda" and (
            sum(r.path.stat().st_size for r in refs) < 0.5 * torch.cuda.mem_get_info(dist.device)[0])
    cache, preload_s = None, 0.0
    if preload:
        t0 = time.perf_counter()
        cache = preload_samples(refs, cfg.max_length, dist.device)
        preload_s = time.perf_counter() - t0
        log(f"train: preloaded {len(cache)} samples onto {dist.device} in {preload_s:.1f} s")
    return batches_forever(refs, cfg, cache, start_step, dist.rank, dist.world), preload_s


def attention_impl(cfg: TrainConfig, device: torch.device) -> str:
    """"padded", "flash" or "math" (see `TrainConfig.attention`)."""
    if cfg.attention == "auto":
        return "flash" if device.type == "cuda" else "math"
    if cfg.attention == "flash" and device.type != "cuda":
        raise ValueError(f"training.attention 'flash' needs a CUDA device (training on {device}); use 'auto' or 'math'")
    return cfg.attention


def check_cuda_graph(cfg: TrainConfig, attention: str, device: torch.device, world: int) -> None:
    """training.cuda_graph's conditions, checked before anything is loaded."""
    if device.type != "cuda":
        raise ValueError(f"training.cuda_graph needs a CUDA device (training on {device}); set it to false")
    if attention != "flash":
        raise ValueError(f"training.cuda_graph needs the packed flash attention (training.attention {cfg.attention!r} "
                         f"gives {attention!r}); use 'auto' or 'flash'")
    if world > 1:
        raise ValueError(f"training.cuda_graph runs in one process (nproc {world}): DDP's all-reduce is not captured")


def run_forward(model, target_head: torch.Tensor, t2d: torch.Tensor, draft_vocab_size: int, batch: dict,
                cfg: TrainConfig, device):
    """The TTT forward on one batch and its loss: (loss, per-step losses, per-step top-1 tallies)."""
    impl = attention_impl(cfg, device)
    if impl != "padded":
        return run_forward_packed(model, target_head, t2d, draft_vocab_size, batch, cfg, device, impl)
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items() if k != "lengths"}
    batch = dequantize_features(batch)  # fp8 files: hidden states times their scales, here on the device
    # The target's distribution: lm_head(last hidden state), or the stored top-k.
    target_p, target_in_draft = teacher_distribution(batch, target_head, t2d, draft_vocab_size)
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        step_logits = model(batch["input_ids"], batch["aux_hidden_states"].to(torch.float32), steps=cfg.ttt_steps)
    return ttt_loss(step_logits, target_p, target_in_draft, batch["loss_mask"], cfg.loss_decay)


def packed_geometry(lengths: torch.Tensor) -> dict[str, torch.Tensor]:
    """cu_seqlens [S+1] (int32), positions [N] (index within the sample) and sample_end [N] of a
    packed row whose samples have `lengths` (on the CPU; zero lengths allowed)."""
    starts = torch.cumsum(lengths, 0) - lengths
    return {"cu_seqlens": torch.cat((starts, lengths.sum()[None])).to(torch.int32),
            "positions": torch.arange(int(lengths.sum())) - torch.repeat_interleave(starts, lengths),
            "sample_end": torch.repeat_interleave(starts + lengths, lengths)}


def run_forward_packed(model, target_head: torch.Tensor, t2d: torch.Tensor, draft_vocab_size: int, batch: dict,
                       cfg: TrainConfig, device, impl: str):
    """`run_forward` on a packed row (`pack_batch`): bounds and positions from the CPU lengths."""
    lengths = batch["lengths"]
    batch = {k: v.to(device, non_blocking=True) for k, v in {**batch, **packed_geometry(lengths)}.items()
             if k != "lengths"}
    return packed_forward_on_device(model, target_head, t2d, draft_vocab_size, batch, cfg, device, impl,
                                    int(lengths.max()))


def packed_forward_on_device(model, target_head, t2d, draft_vocab_size: int, batch: dict, cfg: TrainConfig, device,
                             impl: str, max_len: int, static: bool = False, draft_head: torch.Tensor | None = None):
    """The packed forward and loss on a row whose tensors and geometry are on the device.
    `static` (the CUDA graph's step): every row goes through the head, and autocast keeps no
    cache of cast weights (a graph must recast them on every replay); `draft_head` as in
    `packed_teacher`."""
    batch = dequantize_features(batch)
    teacher = packed_teacher(batch, target_head, t2d, draft_vocab_size, draft_head=draft_head)
    compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda",
                        cache_enabled=not static):
        step_hidden = model(batch["input_ids"], batch["aux_hidden_states"].to(torch.float32), steps=cfg.ttt_steps,
                            cu_seqlens=batch["cu_seqlens"], positions=batch["positions"], max_len=max_len,
                            attention=impl)
        drafter = model.module if hasattr(model, "module") else model
        return packed_ttt_loss(step_hidden, drafter, teacher, batch["loss_mask"], batch["sample_end"], cfg.loss_decay,
                               cfg.loss_chunk_tokens, compute_dtype, cfg.compile and device.type == "cuda",
                               all_rows=static)


# ---------------------------------------------------------------------------------------------
# Static-shape packed rows and the CUDA-graphed training step (training.cuda_graph)
# ---------------------------------------------------------------------------------------------

_GEOMETRY = ("cu_seqlens", "positions", "sample_end")


def static_max_len(cfg: TrainConfig) -> int:
    """The fixed longest segment of a static row (FlashAttention's max_seqlen): max_length, at
    most batch_tokens. Samples are truncated to it, and the padding is cut into pieces of it."""
    return min(cfg.max_length or cfg.batch_tokens, cfg.batch_tokens)


def static_segments(refs: list[SampleRef], cfg: TrainConfig, epochs: int) -> int:
    """Entries of a static row's cu_seqlens minus one: the most samples of any batch the plan
    cuts in `epochs` epochs (the same rng sequence as `batches_forever`), plus the padding
    pieces. Too many slack entries cost the flash kernel empty blocks, so the plan is counted."""
    rng = random.Random(cfg.seed)
    most = max(len(b) for _ in range(max(1, epochs)) for b in plan_epoch(refs, cfg.batch_tokens, cfg.max_length, rng,
                                                                          packed=True))
    return most + math.ceil(cfg.batch_tokens / static_max_len(cfg))


def static_lengths(lengths: torch.Tensor, tokens: int, segments: int, max_len: int) -> torch.Tensor:
    """The segment lengths of a static row of `tokens` tokens: the samples' (the row cut at
    `tokens`, as a longer sample is truncated), then padding pieces of at most max_len, then
    zero-length segments up to `segments`."""
    real = torch.clamp(tokens - (torch.cumsum(lengths, 0) - lengths), min=0).minimum(lengths)
    real = real[real > 0]
    pad = tokens - int(real.sum())
    pieces = [max_len] * (pad // max_len) + ([pad % max_len] if pad % max_len else [])
    if len(real) + len(pieces) > segments:
        raise ValueError(f"a packed row of {len(lengths)} samples needs {len(real) + len(pieces)} segments, more "
                         f"than the static row's {segments} (training.cuda_graph)")
    return torch.cat((real, torch.tensor(pieces, dtype=lengths.dtype),
                      torch.zeros(segments - len(real) - len(pieces), dtype=lengths.dtype)))


def static_buffers(batch: dict[str, torch.Tensor], tokens: int, segments: int, device) -> dict[str, torch.Tensor]:
    """Zeroed device tensors of a static row for the keys of `batch` (`pack_batch`): [tokens, ...]
    per data key in its dtype, and the geometry (cu_seqlens [segments + 1])."""
    out = {k: torch.zeros((tokens, *v.shape[1:]), dtype=v.dtype, device=device)
           for k, v in batch.items() if k != "lengths"}
    out["cu_seqlens"] = torch.zeros(segments + 1, dtype=torch.int32, device=device)
    out["positions"] = torch.zeros(tokens, dtype=torch.int64, device=device)
    out["sample_end"] = torch.zeros(tokens, dtype=torch.int64, device=device)
    return out


def fill_static(static: dict[str, torch.Tensor], batch: dict[str, torch.Tensor], max_len: int) -> None:
    """Copy a packed batch into the static row, in place: the padding has ids, loss mask and
    features 0 (a segment of its own, never counted)."""
    tokens, segments = static["positions"].shape[0], static["cu_seqlens"].shape[0] - 1
    if set(static) != set(batch) - {"lengths"} | set(_GEOMETRY):
        raise ValueError(f"the batch's keys {sorted(batch)} differ from the captured ones {sorted(static)}")
    lengths = static_lengths(batch["lengths"], tokens, segments, max_len)
    n = min(int(batch["lengths"].sum()), tokens)
    for key, buf in static.items():
        if key not in _GEOMETRY:
            buf[:n].copy_(batch[key][:n], non_blocking=True)
            buf[n:].zero_()
    for key, value in packed_geometry(lengths).items():
        static[key].copy_(value, non_blocking=True)


class GraphedStep:
    """The whole training step (forward, loss, backward, grad clip, AdamW) captured in one CUDA
    graph over static buffers, replayed per batch. The optimizer must be capturable with a
    device-tensor lr (`graph_optimizer`), set by fill_ before each replay. The warm-up steps
    that precede the capture (on a side stream, as the PyTorch docs show) train on the first
    batch; the weights and optimizer state are put back afterwards, in place, so the run's
    trajectory starts where the eager one does. Parameters are updated in place: saving reads
    them as always."""

    def __init__(self, model, target_head, t2d, draft_vocab_size: int, cfg: TrainConfig, device, optimizer,
                 first_batch: dict, segments: int, warmup: int = 3):
        if device.type != "cuda":
            raise ValueError(f"training.cuda_graph needs a CUDA device (training on {device})")
        self.model, self.optimizer, self.cfg = model, optimizer, cfg
        self.max_len = static_max_len(cfg)
        self.static = static_buffers(first_batch, cfg.batch_tokens, segments, device)
        fill_static(self.static, first_batch, self.max_len)
        self.lr = optimizer.param_groups[0]["lr"]
        if not (torch.is_tensor(self.lr) and self.lr.device.type == device.type and optimizer.param_groups[0]["capturable"]):
            raise ValueError("GraphedStep needs an AdamW with capturable=True and lr a device tensor (graph_optimizer)")

        draft_head = target_head[t2d]  # frozen: made once, outside the graph

        def step():
            loss, losses, tallies = packed_forward_on_device(
                model, target_head, t2d, draft_vocab_size, self.static, cfg, device, "flash", self.max_len,
                static=True, draft_head=draft_head)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            return loss.detach(), torch.stack(losses), tallies, grad_norm

        params = {k: v.detach().clone() for k, v in model.state_dict().items()}
        opt_state = {p: {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
                     for p, st in optimizer.state.items()}
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                step()
        torch.cuda.current_stream(device).wait_stream(side)
        if not drafter_module._Flash.ok:
            raise RuntimeError("training.cuda_graph: the FlashAttention varlen ops failed in the warm-up (see the "
                               "warning); the math fallback reads bounds on the host and cannot be captured")
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = step()
        # Put back the weights and the optimizer state (in place: the graph holds their addresses).
        with torch.no_grad():
            for k, v in model.state_dict().items():
                v.copy_(params[k])
            for p, st in optimizer.state.items():
                for k, v in st.items():
                    if torch.is_tensor(v):
                        v.copy_(opt_state[p][k]) if p in opt_state else v.zero_()

    def __call__(self, batch: dict, lr: float):
        """Train on `batch` at `lr`: (loss, per-step losses [steps], tallies [steps, 2], grad norm),
        copies of the graph's outputs (the next replay overwrites them)."""
        fill_static(self.static, batch, self.max_len)
        self.lr.fill_(lr)
        self.graph.replay()
        return tuple(x.clone() for x in self.outputs)


def graph_optimizer(model, cfg: TrainConfig, device) -> torch.optim.AdamW:
    """The run's AdamW, capturable, with lr a device tensor (what `GraphedStep` captures)."""
    return torch.optim.AdamW(model.parameters(), lr=torch.tensor(cfg.lr, device=device), weight_decay=cfg.weight_decay,
                             betas=(0.9, 0.95), capturable=True)


def make_graph_capturable(optimizer, device) -> None:
    """After loading a state saved without the graph: the lr back to a device tensor, capturable on."""
    for group in optimizer.param_groups:
        group["capturable"] = True
        if not torch.is_tensor(group["lr"]):
            group["lr"] = torch.tensor(float(group["lr"]), device=device)
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].to(device=device, dtype=torch.float32)


def run_backward_and_update(loss: torch.Tensor, model, optimizer, lr: float, cfg: TrainConfig) -> torch.Tensor:
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    return grad_norm


@dataclass
class Progress:
    """What the run has done so far: saved in the state, reported at the end."""

    step: int = 0
    tokens_seen: int = 0
    loss_history: list[float] = field(default_factory=list)
    curve: list[dict] = field(default_factory=list)  # the logged points: step, time, loss, lr, accuracy
    snapshots: list[dict] = field(default_factory=list)  # the copies written at snapshot_at_s: train_s, step, path


def train_drafter(job: TrainJob, log: Callable[[str], None] = print,
                  on_point: Callable[[dict], None] | None = None) -> dict:
    """Train a drafter until max_steps or the time budget (or a pause) and save it to `job.out_dir`.
    `on_point(point)` gets each learning-curve point as it is logged (rank 0), to report it live."""
    cfg = job.config
    torch.manual_seed(cfg.seed)
    dist = setup(cfg.device)
    device = dist.device
    if not dist.main:
        log = lambda msg: None  # noqa: E731 (rank 0 reports for all)

    # -- model, data plan, optimizer ---------------------------------------------------------
    attention = attention_impl(cfg, device)  # a bad setting fails here, before any loading
    if cfg.cuda_graph:
        check_cuda_graph(cfg, attention, device, dist.world)
    model, target_head = build_draft_model(job, device)
    refs = list_samples(job.shard_dirs)
    batches_per_epoch, max_steps = plan_steps(cfg, refs, dist.world)
    log(f"train: {len(refs)} samples, {sum(r.tokens for r in refs):,} tokens, {batches_per_epoch} batches per epoch, "
        f"{max_steps} steps, {sum(p.numel() for p in model.parameters()):,} drafter parameters, device {device}, "
        f"attention {attention}")
    if cfg.cuda_graph:
        optimizer = graph_optimizer(model, cfg, device)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))

    # -- resume --------------------------------------------------------------------------------
    fingerprint = state_fingerprint(refs, job, dist.world)
    progress, trained_before_s = Progress(), 0.0
    state = load_state(job.state_path, fingerprint, device)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if cfg.cuda_graph:
            make_graph_capturable(optimizer, device)
        progress = Progress(state["step"], state["tokens_seen"], state["loss_history"], state["curve"],
                            state.get("snapshots", []))
        trained_before_s = state["train_s"]
        torch.set_rng_state(state["rng"].cpu())  # map_location moved it to the GPU
        log(f"train: resumed from {job.state_path} at step {progress.step} of {max_steps} "
            f"({trained_before_s:.0f} s trained so far)")
    resumed_from = progress.step
    data, preload_s = build_data(refs, cfg, dist, resumed_from, log)
    ddp = torch.nn.parallel.DistributedDataParallel(model) if dist.world > 1 else model
    clock = StopClock(cfg, dist, trained_before_s, job.stop_after_s)
    previous_handler = _stop_on_sigterm(clock)
    window: deque[torch.Tensor] = deque(maxlen=cfg.acc_window)  # [steps, 2] tallies per batch
    pending: list[torch.Tensor] = []  # losses still on the device, read back at log/save points
    graphed: GraphedStep | None = None  # training.cuda_graph: captured on the first batch

    def flush_losses() -> None:
        if pending:
            progress.loss_history.extend(torch.stack(pending).tolist())
            pending.clear()

    def save_state() -> None:
        flush_losses()
        write_state(job.state_path, fingerprint, model, optimizer, progress, clock.trained_s)

    # -- the loop -------------------------------------------------------------------------------
    stopped = "max_steps"
    try:
        for step in range(resumed_from, max_steps):
            # termination conditions (besides max_steps)
            reason = clock.check(step, resumed_from)
            if reason:
                stopped = reason
                log(f"train: {'time budget reached' if reason == 'time_budget' else 'paused'} after {step} steps "
                    f"({clock.trained_s:.0f} s of training in all)")
                break
            lr = learning_rate(step, cfg, max_steps, clock.time_fraction())
            batch = next(data)
            batch_tokens = int(batch["lengths"].sum())  # lengths stay on the CPU: no sync
            if cfg.cuda_graph:
                if graphed is None:
                    epochs = min(math.ceil(max_steps / batches_per_epoch) + 1, 200)  # more: a max over 200 plans
                    graphed = GraphedStep(model, target_head, model.t2d, job.draft_vocab_size, cfg, device, optimizer,
                                          batch, static_segments(refs, cfg, epochs))
                loss, step_losses, tallies, grad_norm = graphed(batch, lr)
            else:
                loss, step_losses, tallies = run_forward(ddp, target_head, model.t2d, job.draft_vocab_size, batch, cfg,
                                                         device)
                grad_norm = run_backward_and_update(loss, model, optimizer, lr, cfg)

            progress.step = step + 1
            progress.tokens_seen += dist.sum(batch_tokens)
            pending.append(loss.detach())
            window.append(tallies)
            if step % cfg.log_every == 0 or step == max_steps - 1:
                flush_losses()
                elapsed = clock.trained_s
                progress.curve.append({"step": step, "time_s": round(elapsed, 2), "loss": round(loss.item(), 5), "lr": lr,
                                       "accuracy": [round(a, 4) for a in window_accuracy(window)],
                                       "tokens_seen": progress.tokens_seen})
                if on_point is not None and dist.main:
                    on_point(progress.curve[-1])
                log(f"step {step:5d} | loss {loss.item():.4f} | step-0 loss {float(step_losses[0]):.4f} | "
                    f"acc {' '.join(f'{a:.2f}' for a in window_accuracy([tallies]))} | lr {lr:.2e} | "
                    f"grad {float(grad_norm):.2f} | {progress.tokens_seen / elapsed:,.0f} tok/s")
            if job.state_path and dist.main and progress.step % cfg.save_every == 0 and progress.step < max_steps:
                save_state()
            if dist.main:
                write_due_snapshots(model, job, progress, clock.trained_s, log)
    finally:
        for sig, handler in previous_handler.items():
            signal.signal(sig, handler)

    # -- the checkpoint, and the state kept or cleared -------------------------------------------
    flush_losses()
    train_s = clock.trained_s
    run_s = time.perf_counter() - clock.run_start
    paused = stopped == "paused"
    if dist.main:
        # a value the stopping time passed after the last step's check: these are its weights
        write_due_snapshots(model, job, progress, train_s, log)
        if job.state_path and paused:  # before the checkpoint moves the weights to the CPU
            save_state()
        save_checkpoint(model.cpu(), Path(job.out_dir), dtype=getattr(torch, cfg.checkpoint_dtype))
        log(f"train: saved drafter to {job.out_dir} after {progress.step} steps, {train_s:.1f} s")
        if job.state_path and not paused:
            Path(job.state_path).unlink(missing_ok=True)  # finished: a rerun trains afresh
    dist.barrier()
    run_tokens = progress.tokens_seen - (state["tokens_seen"] if state is not None else 0)
    return {
        "steps": progress.step,
        "max_steps": max_steps,
        "stopped": stopped,
        "paused": paused,
        "epochs": progress.step * dist.world / batches_per_epoch,
        "curve": progress.curve,
        "snapshots": progress.snapshots,
        "preload_s": preload_s,
        "tokens_seen": progress.tokens_seen,
        "final_loss": progress.loss_history[-1] if progress.loss_history else float("nan"),
        "loss_history": progress.loss_history,
        "step_accuracy": window_accuracy(window) or [0.0] * cfg.ttt_steps,
        "accuracy_window_batches": len(window),
        "train_s": train_s,
        "run_s": run_s,
        "tokens_per_s": run_tokens / run_s if run_s > 0 else 0.0,
        "samples": len(refs),
        "resumed_from_step": resumed_from,
        "processes": dist.world,
        "device": str(device),
        "attention": attention if attention != "flash" or drafter_module._Flash.ok else "math (flash failed)",
    }


def write_due_snapshots(model, job: TrainJob, progress: Progress, trained_s: float, log) -> None:
    """A checkpoint copy at each `snapshot_at_s` the training time (over all runs) has passed
    and no run has written yet: <out_dir>/snapshots/t<seconds>/, the final checkpoint's writer
    and dtype. A threshold passed by several at once gets one copy each (same weights)."""
    done = {s["at_s"] for s in progress.snapshots}
    for at_s in sorted(job.config.snapshot_at_s):
        if at_s > trained_s or at_s in done:
            continue
        fraction = "" if float(at_s).is_integer() else f"{at_s % 1:.3f}"[1:]  # t00300, or t00000.500
        path = Path(job.out_dir) / "snapshots" / f"t{int(at_s):05d}{fraction}"
        save_checkpoint(model, path, dtype=getattr(torch, job.config.checkpoint_dtype))
        progress.snapshots.append({"at_s": at_s, "train_s": round(trained_s, 2), "step": progress.step, "path": str(path)})
        log(f"train: snapshot at {trained_s:.1f} s of training (step {progress.step}) in {path}")


# ---------------------------------------------------------------------------------------------
# The resumable state
# ---------------------------------------------------------------------------------------------


def state_fingerprint(refs: list[SampleRef], job: TrainJob, world: int) -> str:
    """What a saved state was trained on; a state for other data or settings is not resumed.
    Knobs that do not change the trajectory (logging, saving, the time limits) are left out."""
    ignored = {"log_every", "save_every", "time_budget_s", "preload", "device", "snapshot_at_s", "loss_chunk_tokens",
               "cuda_graph"}
    cfg = {k: v for k, v in asdict(job.config).items() if k not in ignored}
    try:
        with safe_open(str(refs[0].path), framework="pt") as f:  # the same paths in another layout are other data
            files = [sorted(f.keys()), {k: v for k, v in (f.metadata() or {}).items() if k != "checksum"}]  # layout
    except Exception as e:
        raise DamagedSampleError(refs[0].path, e) from e
    blob = json.dumps([[str(r.path), r.tokens] for r in refs] + [cfg, job.draft_vocab_size, list(job.aux_layer_ids), world,
                                                                  files], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def write_state(path, fingerprint: str, model, optimizer, progress: Progress, train_s: float) -> None:
    with atomic_path(path) as tmp:  # a killed save leaves the previous state intact
        torch.save({"fingerprint": fingerprint, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "step": progress.step, "tokens_seen": progress.tokens_seen, "loss_history": progress.loss_history,
                    "curve": progress.curve, "snapshots": progress.snapshots, "train_s": train_s,
                    "rng": torch.get_rng_state()}, tmp)


def load_state(path, fingerprint: str, device):
    if not path or not Path(path).is_file():
        return None
    state = torch.load(path, map_location=device, weights_only=False)
    return state if state.get("fingerprint") == fingerprint else None
