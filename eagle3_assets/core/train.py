"""Train the EAGLE-3 drafter on extracted hidden states (nanoGPT-style: the loop is the code).

Inputs: shard directories in the hidden-state file contract (one safetensors file per sample:
input_ids, loss_mask, aux_hidden_states, last_hidden_state), the target's folder (for its
embeddings and lm_head only), and the vocab map. Output: an official EAGLE-3 checkpoint.

The loss is the official `traineagle3` one: at TTT step k the drafter's distribution at index
t is fitted (soft cross-entropy) to the target's distribution over the draft vocabulary at
position t+k+1, i.e. for token t+k+2; positions whose target argmax is outside the draft
vocabulary are masked; total = sum_k loss_decay^k * loss_k.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import polars as pl
import torch
from safetensors import safe_open

from eagle3_assets.core.drafter import DrafterConfig, Eagle3Drafter, save_checkpoint
from eagle3_assets.core.vocab import load_vocab_map

MANIFEST = "manifest.parquet"


@dataclass
class TrainConfig:
    steps_ttt: int = 7
    loss_decay: float = 0.8
    lr: float = 1e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 50
    max_steps: int = 1000  # optimizer steps (one batch each); epochs repeat as needed
    batch_tokens: int = 8192  # max padded tokens per batch (B * T_max)
    grad_clip: float = 0.5
    weight_decay: float = 0.0
    seed: int = 0
    max_length: int = 2048  # longer samples are truncated
    device: str = "cpu"
    log_every: int = 10
    acc_window: int = 50  # per-step accuracy is measured over the last this many batches
    checkpoint_dtype: str = "bfloat16"
    # Keep every sample in memory (on `device`) after one read, instead of reading each batch
    # from disk: on a GPU with room for the shards this removes the per-step file reads.
    preload: bool = False
    # Resumable training: the full state (weights, optimizer, step, history) is saved to
    # `state_path` every `save_every` steps; a run that finds a matching state resumes from it.
    state_path: str | None = None
    save_every: int = 50
    # Stop after this many seconds of training even if max_steps is not reached; the LR schedule
    # then follows the larger of the step and time fractions, so it still ends fully decayed.
    time_budget_s: float | None = None
    # Pause: stop this run after this many seconds of training and keep the state (with the
    # training time so far) for the next run to continue; unlike time_budget_s it leaves the
    # schedule alone, so one run can span several time-limited slots.
    stop_after_s: float | None = None


# ---------------------------------------------------------------------------------------------
# Data: stream sample files in length-bucketed, right-padded batches
# ---------------------------------------------------------------------------------------------


@dataclass
class SampleRef:
    path: Path
    tokens: int


def list_samples(shard_dirs: list[str | Path]) -> list[SampleRef]:
    """Sample files of each shard: from its manifest when present, else a glob."""
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


def plan_epoch(refs: list[SampleRef], batch_tokens: int, max_length: int, rng: random.Random) -> list[list[SampleRef]]:
    """Shuffle, then sort within pools of ~64 batches by length and cut batches whose padded
    size (count * longest) stays within batch_tokens; the batch order is shuffled again.
    Sorting only within a pool keeps batches similar in length without a fixed order."""
    order = refs[:]
    rng.shuffle(order)
    mean_len = sum(min(r.tokens, max_length) for r in refs) / len(refs)
    pool_size = max(1, int(64 * batch_tokens / max(mean_len, 1)))
    batches = []
    for start in range(0, len(order), pool_size):
        pool = sorted(order[start : start + pool_size], key=lambda r: r.tokens)
        batch, longest = [], 0
        for ref in pool:
            length = min(ref.tokens, max_length)
            if batch and max(longest, length) * (len(batch) + 1) > batch_tokens:
                batches.append(batch)
                batch, longest = [], 0
            batch.append(ref)
            longest = max(longest, length)
        if batch:
            batches.append(batch)
    rng.shuffle(batches)
    return batches


def load_batch(batch: list[SampleRef], max_length: int) -> dict[str, torch.Tensor]:
    """Read a batch from disk and right-pad it; `lengths` gives each sample's true length."""
    samples = []
    for ref in batch:
        with safe_open(str(ref.path), framework="pt") as f:
            samples.append({key: f.get_slice(key)[:max_length] for key in
                            ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state")})
    return pad_batch(samples)


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


def preload_samples(refs: list[SampleRef], max_length: int, device: torch.device) -> dict:
    """Read every sample once (truncated to max_length) onto `device`: path -> tensors."""
    cache = {}
    for ref in refs:
        with safe_open(str(ref.path), framework="pt") as f:
            cache[ref.path] = {key: f.get_slice(key)[:max_length].to(device) for key in
                               ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state")}
    return cache


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

    return {
        "input_ids": pad("input_ids", torch.int64),
        "loss_mask": pad("loss_mask", torch.int64),
        "aux_hidden_states": pad("aux_hidden_states", samples[0]["aux_hidden_states"].dtype),
        "last_hidden_state": pad("last_hidden_state", samples[0]["last_hidden_state"].dtype),
        "lengths": torch.tensor([s["input_ids"].shape[0] for s in samples]),
    }


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
# The loop
# ---------------------------------------------------------------------------------------------


def learning_rate(step: int, cfg: TrainConfig, time_fraction: float = 0.0) -> float:
    """Linear warm-up, then cosine decay to lr * min_lr_ratio at max_steps (nanoGPT's get_lr).
    `time_fraction` (elapsed / time budget) ends the decay early when time runs out first."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    progress = max(progress, time_fraction)
    coeff = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + coeff * (1.0 - cfg.min_lr_ratio))


def train_drafter(
    shard_dirs: list[str | Path],
    target_model_dir: str | Path,
    vocab_map_path: str | Path,
    out_dir: str | Path,
    aux_layer_ids: list[int],
    draft_vocab_size: int,
    cfg: TrainConfig,
    log: Callable[[str], None] = print,
) -> dict:
    """Train a drafter for `cfg.max_steps` optimizer steps and save it to `out_dir`."""
    from transformers import AutoConfig

    torch.manual_seed(cfg.seed)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device(cfg.device)
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if rank != 0:
        log = lambda msg: None  # noqa: E731 (rank 0 reports for all)
    use_bf16 = device.type == "cuda"

    # -- model -------------------------------------------------------------------------------
    d2t, t2d = load_vocab_map(vocab_map_path)
    if d2t.numel() != draft_vocab_size:
        raise ValueError(f"vocab map {vocab_map_path} has {d2t.numel()} draft tokens, expected draft_vocab_size={draft_vocab_size}")
    embed, lm_head, _ = load_target_head(target_model_dir)
    config = DrafterConfig.from_target_config(AutoConfig.from_pretrained(target_model_dir), draft_vocab_size, aux_layer_ids)
    model = Eagle3Drafter(config, embed)
    model.set_vocab_map(d2t, t2d)
    model.to(device)
    model.embed_tokens = model.embed_tokens.to(torch.bfloat16 if use_bf16 else torch.float32)
    target_head = lm_head.to(device=device, dtype=torch.bfloat16 if use_bf16 else torch.float32)
    t2d = model.t2d

    refs = list_samples(shard_dirs)
    log(f"train: {len(refs)} samples, {sum(r.tokens for r in refs):,} tokens, "
        f"{sum(p.numel() for p in model.parameters()):,} drafter parameters, device {device}")
    preload_s = 0.0
    cache = None
    if cfg.preload:
        t_pre = time.perf_counter()
        cache = preload_samples(refs, cfg.max_length, device)
        preload_s = time.perf_counter() - t_pre
        log(f"train: preloaded {len(cache)} samples onto {device} in {preload_s:.1f} s")

    ddp = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    loss_history, tokens_seen = [], 0
    curve: list[dict] = []  # the logged points: step, time, loss, per-step accuracy
    window: deque[torch.Tensor] = deque(maxlen=cfg.acc_window)  # [steps, 2] tallies per batch
    pending: list[torch.Tensor] = []  # losses still on the device, read back at log/save points

    def flush_losses() -> None:
        if pending:
            loss_history.extend(torch.stack(pending).tolist())
            pending.clear()
    start_step = 0
    fingerprint = _state_fingerprint(refs, cfg, draft_vocab_size, aux_layer_ids, world)
    state = _load_state(cfg.state_path, fingerprint, device)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_step, tokens_seen = state["step"], state["tokens_seen"]
        loss_history, curve = state["loss_history"], state["curve"]
        torch.set_rng_state(state["rng"].cpu())  # map_location moved it to the GPU
        log(f"train: resumed from {cfg.state_path} at step {start_step} of {cfg.max_steps}")
    data = batches_forever(refs, cfg, cache, start_step, rank, world)
    t_run = time.perf_counter()
    # Training time counts over resumed runs, so a time budget spans them all.
    t0 = t_run - (state.get("train_s", 0.0) if state is not None else 0.0)
    steps_done, paused = start_step, False

    for step in range(start_step, cfg.max_steps):
        if world == 1 or (step - start_step) % cfg.log_every == 0:
            now = time.perf_counter()
            trained_s, run_s = _elapsed_on_rank0([now - t0, now - t_run], world, device)
        time_fraction = trained_s / cfg.time_budget_s if cfg.time_budget_s else 0.0
        if time_fraction >= 1.0:
            log(f"train: time budget of {cfg.time_budget_s:.0f} s reached after {step} steps")
            break
        if cfg.stop_after_s is not None and run_s >= cfg.stop_after_s and step > start_step:  # never 0 steps
            paused = True
            log(f"train: paused after {step} steps ({cfg.stop_after_s:.0f} s for this run)")
            break
        lr = learning_rate(step, cfg, time_fraction)
        for group in optimizer.param_groups:
            group["lr"] = lr

        batch = next(data)
        batch_tokens = int(batch["lengths"].sum())  # lengths stay on the CPU: no sync
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items() if k != "lengths"}
        # The target's distribution, from its stored final hidden state: lm_head(last).
        target_p, target_in_draft = target_distribution(batch["last_hidden_state"], target_head, t2d)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_bf16):
            step_logits = ddp(
                batch["input_ids"], batch["aux_hidden_states"].to(torch.float32), steps=cfg.steps_ttt
            )
        loss, step_losses, tallies = ttt_loss(step_logits, target_p, target_in_draft, batch["loss_mask"], cfg.loss_decay)

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()

        tokens_seen += _sum_over_ranks(batch_tokens, world, device)
        pending.append(loss.detach())
        window.append(tallies)
        steps_done = step + 1
        if step % cfg.log_every == 0 or step == cfg.max_steps - 1:
            flush_losses()
            elapsed = time.perf_counter() - t0
            acc = window_accuracy([tallies])
            win_acc = window_accuracy(window)
            curve.append({"step": step, "time_s": round(elapsed, 2), "loss": round(loss.item(), 5),
                          "lr": lr, "accuracy": [round(a, 4) for a in win_acc], "tokens_seen": tokens_seen})
            log(f"step {step:5d} | loss {loss.item():.4f} | step-0 loss {float(step_losses[0]):.4f} | "
                f"acc {' '.join(f'{a:.2f}' for a in acc)} | lr {lr:.2e} | grad {float(grad_norm):.2f} | "
                f"{tokens_seen / elapsed:,.0f} tok/s")
        if cfg.state_path and rank == 0 and (steps_done % cfg.save_every == 0) and steps_done < cfg.max_steps:
            flush_losses()
            _save_state(cfg.state_path, fingerprint, model, optimizer, steps_done, tokens_seen, loss_history, curve,
                        time.perf_counter() - t0)

    flush_losses()
    train_s = time.perf_counter() - t0
    step_accuracy = window_accuracy(window) or [0.0] * cfg.steps_ttt
    out_dir = Path(out_dir)
    if rank == 0:
        if cfg.state_path and paused:  # before the checkpoint moves the weights to the CPU
            _save_state(cfg.state_path, fingerprint, model, optimizer, steps_done, tokens_seen, loss_history,
                        curve, train_s)
        save_checkpoint(model.cpu(), out_dir, dtype=getattr(torch, cfg.checkpoint_dtype))
        log(f"train: saved drafter to {out_dir} after {steps_done} steps, {train_s:.1f} s")
        if cfg.state_path and not paused:
            Path(cfg.state_path).unlink(missing_ok=True)  # finished: a rerun trains afresh
    if world > 1:
        torch.distributed.barrier()
    return {
        "steps": steps_done,
        "curve": curve,
        "preload_s": preload_s,
        "tokens_seen": tokens_seen,
        "final_loss": loss_history[-1],
        "loss_history": loss_history,
        "step_accuracy": step_accuracy,
        "accuracy_window_batches": len(window),
        "train_s": train_s,
        "tokens_per_s": tokens_seen / train_s if train_s > 0 else 0.0,
        "samples": len(refs),
        "resumed_from_step": state["step"] if state is not None else 0,
        "processes": world,
        "paused": paused,
    }


# ---------------------------------------------------------------------------------------------
# Resumable state and DDP helpers
# ---------------------------------------------------------------------------------------------


def _state_fingerprint(refs, cfg: TrainConfig, draft_vocab_size: int, aux_layer_ids, world: int) -> str:
    """What a saved state was trained on; a state for other data or settings is not resumed."""
    import hashlib

    keys = {k: v for k, v in vars(cfg).items() if k not in ("log_every", "state_path", "save_every", "time_budget_s", "stop_after_s")}
    blob = json.dumps([str(r.path) for r in refs] + [r.tokens for r in refs] + [keys, draft_vocab_size,
                      list(aux_layer_ids), world], default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _save_state(path, fingerprint, model, optimizer, step, tokens_seen, loss_history, curve, train_s) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save({"fingerprint": fingerprint, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "step": step, "tokens_seen": tokens_seen, "loss_history": loss_history, "curve": curve,
                "train_s": train_s, "rng": torch.get_rng_state()}, tmp)
    os.replace(tmp, path)  # a killed save leaves the previous state intact


def _load_state(path, fingerprint, device):
    if not path or not Path(path).is_file():
        return None
    state = torch.load(path, map_location=device, weights_only=False)
    return state if state.get("fingerprint") == fingerprint else None


def _elapsed_on_rank0(clocks: list[float], world: int, device) -> list[float]:
    """Rank 0's clocks for every rank: the LR and the time limits then agree across ranks (one
    rank stopping alone would leave the others waiting in the gradient all-reduce). With several
    ranks the caller reads them every log_every steps, as the broadcast waits for the GPU."""
    if world == 1:
        return clocks
    t = torch.tensor(clocks, dtype=torch.float64, device=device)
    torch.distributed.broadcast(t, src=0)
    return t.tolist()


def _sum_over_ranks(value: int, world: int, device) -> int:
    if world == 1:
        return value
    t = torch.tensor([value], device=device)
    torch.distributed.all_reduce(t)
    return int(t.item())
