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
from .drafter import DrafterConfig, Eagle3Drafter, save_checkpoint
from .files import atomic_path
from .sample_files import DamagedSampleError, SampleRef, dequantize_features, list_samples, read_sample_slices
from .stopping import STOP
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
    batch_tokens: PositiveInt = 8192  # max padded tokens per batch (B * T_max) and rank
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
# Data: length-bucketed, right-padded batches, streamed from disk or from preloaded samples
# ---------------------------------------------------------------------------------------------


def plan_epoch(refs: list[SampleRef], batch_tokens: int, max_length: int | None, rng: random.Random) -> list[list[SampleRef]]:
    """Shuffle, then sort within pools of ~64 batches by length and cut batches whose padded
    size (count * longest) stays within batch_tokens; the batch order is shuffled again.
    Sorting only within a pool keeps batches similar in length without a fixed order."""
    order = refs[:]
    rng.shuffle(order)
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


def load_batch(batch: list[SampleRef], max_length: int | None) -> dict[str, torch.Tensor]:
    """Read a batch from disk (as stored: fp8 stays fp8 until the device) and right-pad it;
    `lengths` gives each sample's true length."""
    return pad_batch([read_sample_slices(ref.path, max_length, dequantize=False) for ref in batch])


def batches_forever(
    refs, cfg: TrainConfig, cache: dict | None = None, start_step: int = 0, rank: int = 0, world: int = 1
) -> Iterator[dict[str, torch.Tensor]]:
    """Endless batches, epoch after epoch. With `cache` (see `preload_samples`) batches are
    padded from the in-memory samples; the plan is the same as from disk.

    One plan for all ranks: step s of rank r is batch s * world + r, so DDP ranks see different
    batches, and a resumed run skips the batches it already trained on (planning reads no file)."""
    rng = random.Random(cfg.seed)
    index = 0
    while True:
        for batch in plan_epoch(refs, cfg.batch_tokens, cfg.max_length, rng):
            if index >= start_step * world and index % world == rank:
                yield load_batch(batch, cfg.max_length) if cache is None else _batch_from_cache(batch, cache)
            index += 1


def preload_samples(refs: list[SampleRef], max_length: int | None, device: torch.device) -> dict:
    """Read every sample once (truncated to max_length, as stored) onto `device`: path -> tensors."""
    return {ref.path: {k: v.to(device) for k, v in read_sample_slices(ref.path, max_length, dequantize=False).items()}
            for ref in refs}


def _batch_from_cache(batch: list[SampleRef], cache: dict) -> dict[str, torch.Tensor]:
    return pad_batch([cache[ref.path] for ref in batch])


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
# The target's embeddings and lm_head, read straight from its safetensors
# ---------------------------------------------------------------------------------------------


def load_target_head(target_model_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Return (embed_tokens.weight, lm_head.weight, config dict) of an HF target folder,
    reading only those two tensors (sharded checkpoints are resolved through the index)."""
    target_model_dir = Path(target_model_dir)
    config = json.loads((target_model_dir / "config.json").read_text())
    index = target_model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
    elif (target_model_dir / "model.safetensors").exists():
        with safe_open(str(target_model_dir / "model.safetensors"), framework="pt") as f:
            weight_map = {key: "model.safetensors" for key in f.keys()}
    else:
        raise FileNotFoundError(
            f"{target_model_dir}: no model.safetensors or model.safetensors.index.json; "
            "the target must be a Hugging Face folder with safetensors weights"
        )

    def read(key: str) -> torch.Tensor:
        if key not in weight_map:
            raise KeyError(f"{target_model_dir}: tensor {key!r} not found in the target's safetensors")
        with safe_open(str(target_model_dir / weight_map[key]), framework="pt") as f:
            return f.get_tensor(key)

    embed = read("model.embed_tokens.weight")
    # Tied targets (e.g. SmolLM2) store no lm_head: the embeddings are the head.
    tied = config.get("tie_word_embeddings", False) or "lm_head.weight" not in weight_map
    lm_head = embed if tied else read("lm_head.weight")
    return embed, lm_head, config


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
    model = Eagle3Drafter(config, embed)
    model.set_vocab_map(d2t, t2d)
    model.to(device)
    low = torch.bfloat16 if device.type == "cuda" else torch.float32  # frozen tensors: no master copy needed
    model.embed_tokens = model.embed_tokens.to(low)
    return model, lm_head.to(device=device, dtype=low)


def plan_steps(cfg: TrainConfig, refs: list[SampleRef], world: int) -> tuple[int, int]:
    """(batches per epoch, optimizer steps): `max_steps`, else `epochs` passes over the data."""
    batches = len(plan_epoch(refs, cfg.batch_tokens, cfg.max_length, random.Random(cfg.seed)))
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


def run_forward(model, target_head: torch.Tensor, t2d: torch.Tensor, draft_vocab_size: int, batch: dict,
                cfg: TrainConfig, device):
    """The TTT forward on one batch and its loss: (loss, per-step losses, per-step top-1 tallies)."""
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items() if k != "lengths"}
    batch = dequantize_features(batch)  # fp8 files: hidden states times their scales, here on the device
    # The target's distribution: lm_head(last hidden state), or the stored top-k.
    target_p, target_in_draft = teacher_distribution(batch, target_head, t2d, draft_vocab_size)
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        step_logits = model(batch["input_ids"], batch["aux_hidden_states"].to(torch.float32), steps=cfg.ttt_steps)
    return ttt_loss(step_logits, target_p, target_in_draft, batch["loss_mask"], cfg.loss_decay)


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


def train_drafter(job: TrainJob, log: Callable[[str], None] = print) -> dict:
    """Train a drafter until max_steps or the time budget (or a pause) and save it to `job.out_dir`."""
    cfg = job.config
    torch.manual_seed(cfg.seed)
    dist = setup(cfg.device)
    device = dist.device
    if not dist.main:
        log = lambda msg: None  # noqa: E731 (rank 0 reports for all)

    # -- model, data plan, optimizer ---------------------------------------------------------
    model, target_head = build_draft_model(job, device)
    refs = list_samples(job.shard_dirs)
    batches_per_epoch, max_steps = plan_steps(cfg, refs, dist.world)
    log(f"train: {len(refs)} samples, {sum(r.tokens for r in refs):,} tokens, {batches_per_epoch} batches per epoch, "
        f"{max_steps} steps, {sum(p.numel() for p in model.parameters()):,} drafter parameters, device {device}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))

    # -- resume --------------------------------------------------------------------------------
    fingerprint = state_fingerprint(refs, job, dist.world)
    progress, trained_before_s = Progress(), 0.0
    state = load_state(job.state_path, fingerprint, device)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        progress = Progress(state["step"], state["tokens_seen"], state["loss_history"], state["curve"])
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
            loss, step_losses, tallies = run_forward(ddp, target_head, model.t2d, job.draft_vocab_size, batch, cfg, device)
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
                log(f"step {step:5d} | loss {loss.item():.4f} | step-0 loss {float(step_losses[0]):.4f} | "
                    f"acc {' '.join(f'{a:.2f}' for a in window_accuracy([tallies]))} | lr {lr:.2e} | "
                    f"grad {float(grad_norm):.2f} | {progress.tokens_seen / elapsed:,.0f} tok/s")
            if job.state_path and dist.main and progress.step % cfg.save_every == 0 and progress.step < max_steps:
                save_state()
    finally:
        for sig, handler in previous_handler.items():
            signal.signal(sig, handler)

    # -- the checkpoint, and the state kept or cleared -------------------------------------------
    flush_losses()
    train_s = clock.trained_s
    run_s = time.perf_counter() - clock.run_start
    paused = stopped == "paused"
    if dist.main:
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
    }


# ---------------------------------------------------------------------------------------------
# The resumable state
# ---------------------------------------------------------------------------------------------


def state_fingerprint(refs: list[SampleRef], job: TrainJob, world: int) -> str:
    """What a saved state was trained on; a state for other data or settings is not resumed.
    Knobs that do not change the trajectory (logging, saving, the time limits) are left out."""
    ignored = {"log_every", "save_every", "time_budget_s", "preload", "device"}
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
                    "curve": progress.curve, "train_s": train_s, "rng": torch.get_rng_state()}, tmp)


def load_state(path, fingerprint: str, device):
    if not path or not Path(path).is_file():
        return None
    state = torch.load(path, map_location=device, weights_only=False)
    return state if state.get("fingerprint") == fingerprint else None
