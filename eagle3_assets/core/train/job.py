"""What a training run is: its config (the `training:` section of the settings) and its job."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from annotated_types import Ge, Le

from ..config import STRICT, Fraction, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt


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
    # torch.compile, on CUDA, the loss's per-chunk math (one fused pass over each chunk's logits)
    # and the drafter layer's elementwise math (RMSNorm, RoPE, SiLU gate, the TTT attention's
    # diagonal merge: `drafter.fused_pointwise`); off: eager kernels, several passes.
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
