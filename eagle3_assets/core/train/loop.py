"""The run: `train_drafter` (set up, build the model, the data and the optimizer, restore a saved
state, then the loop, each step one call to a named helper), the learning-rate schedule and the
clock that decides when a run stops."""

from __future__ import annotations

import math
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .. import drafter as drafter_module
from ..distributed import Dist, setup
from ..drafter import DrafterConfig, Eagle3Drafter, save_checkpoint
from ..sample_files import list_samples
from ..stopping import STOP, StopFlag
from ..target import load_target_head
from ..vocab import load_vocab_map
from .data import build_data, plan_steps
from .job import TrainConfig, TrainJob
from .loss import window_accuracy
from .state import Progress, load_state, state_fingerprint, write_state
from .step import (
    GraphedStep,
    attention_impl,
    check_cuda_graph,
    graph_optimizer,
    make_graph_capturable,
    run_backward_and_update,
    run_forward,
    static_shape,
)


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
        self.stop_requested = StopFlag()  # set by a signal handler: no lock (see StopFlag)
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
    # A state at its end (the run finished, but its asset was stopped before recording it)
    # finishes at once: the loop below runs no step, so no data is loaded.
    finished_before = progress.step >= max_steps or bool(cfg.time_budget_s and trained_before_s >= cfg.time_budget_s)
    data, preload_s, head_rows = (None, 0.0, None) if finished_before else build_data(
        refs, cfg, dist, resumed_from, log, teacher_head=(target_head, model.t2d))
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
                    segments, rows = static_shape(refs, cfg, epochs, head_rows)
                    log(f"train: CUDA graph over rows of {cfg.batch_tokens} tokens, {segments} segments, "
                        f"{rows or 'all'} rows through the head")
                    graphed = GraphedStep(model, target_head, model.t2d, job.draft_vocab_size, cfg, device, optimizer,
                                          batch, segments, head_rows=rows)
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
        # Paused or finished, the state is saved (before the checkpoint moves the weights to the
        # CPU). A finished one stays until the drafter asset has its result (`finish_state`): a
        # run stopped between the two finishes at once next time, instead of training afresh.
        if job.state_path and not finished_before:
            save_state()
        save_checkpoint(model.cpu(), Path(job.out_dir), dtype=getattr(torch, cfg.checkpoint_dtype))
        log(f"train: saved drafter to {job.out_dir} after {progress.step} steps, {train_s:.1f} s")
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
        "step_accuracy": (window_accuracy(window) or (progress.curve[-1]["accuracy"] if progress.curve else [])
                          or [0.0] * cfg.ttt_steps),
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


@dataclass
class TrainResult:
    """What a training run returns: `metrics` (`train_drafter`'s dict) for the job `job`."""

    job: TrainJob
    metrics: dict

    @property
    def paused(self) -> bool:
        return self.metrics["paused"]

    def metadata(self) -> dict:
        """The `drafter` asset's metadata, plain JSON values (lists stay lists)."""
        m = self.metrics
        acc = [round(a, 5) for a in m["step_accuracy"]]
        return {
            "steps": m["steps"],
            "stopped_by": m["stopped"],
            "epochs": round(m["epochs"], 3),
            "resumed_from_step": m["resumed_from_step"],
            "tokens_seen": m["tokens_seen"],
            "final_loss": round(m["final_loss"], 5),
            **{f"accuracy_step_{k}": a for k, a in enumerate(acc)},
            "per_step_accuracy": acc,
            "learning_curve": m["curve"],
            "train_s": round(m["train_s"], 2),
            "preload_s": round(m["preload_s"], 2),
            "tokens_per_s": round(m["tokens_per_s"], 1),
            "attention": m["attention"],
            "snapshots": m["snapshots"],
            "processes": m["processes"],
            "aux_layer_ids": list(self.job.aux_layer_ids),
            "device": m["device"],
            "path": self.job.out_dir,
        }


def run_training(job: TrainJob, log: Callable[[str], None] = print,
                 on_point: Callable[[dict], None] | None = None) -> TrainResult:
    """`train_drafter` as a stage: its metrics as a `TrainResult`."""
    return TrainResult(job, train_drafter(job, log, on_point=on_point))


def finish_state(state_path: str | Path | None) -> None:
    """Drop a finished training's state once its result is recorded: the next materialization
    (new settings, `--force`) trains afresh."""
    if state_path:
        Path(state_path).unlink(missing_ok=True)


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
