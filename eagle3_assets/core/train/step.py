"""One training step: the forward and loss on a batch (padded or packed), the backward and AdamW
update, and the same step on static-shape rows captured in one CUDA graph (`GraphedStep`)."""

from __future__ import annotations

import math
import random

import torch

from .. import drafter as drafter_module
from ..sample_files import SampleRef, dequantize_features
from .data import META, plan_epoch
from .job import TrainConfig
from .loss import packed_teacher, packed_ttt_loss, teacher_distribution, ttt_loss


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
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items() if k not in META}
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
             if k not in META}
    return packed_forward_on_device(model, target_head, t2d, draft_vocab_size, batch, cfg, device, impl,
                                    int(lengths.max()))


def packed_forward_on_device(model, target_head, t2d, draft_vocab_size: int, batch: dict, cfg: TrainConfig, device,
                             impl: str, max_len: int, static: bool = False, draft_head: torch.Tensor | None = None,
                             head_rows: int = 0):
    """The packed forward and loss on a row whose tensors and geometry are on the device.
    `static` (the CUDA graph's step): fixed shapes, `head_rows` rows through the head (0: every
    row; `packed_ttt_loss`'s static_rows), and autocast keeps no cache of cast weights (a graph
    must recast them on every replay); `draft_head` as in `packed_teacher`."""
    batch = dequantize_features(batch)
    compiled = cfg.compile and device.type == "cuda"
    teacher = packed_teacher(batch, target_head, t2d, draft_vocab_size, draft_head=draft_head)
    compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda",
                        cache_enabled=not static), \
            drafter_module.fused_pointwise(compiled):
        step_hidden = model(batch["input_ids"], batch["aux_hidden_states"].to(torch.float32), steps=cfg.ttt_steps,
                            cu_seqlens=batch["cu_seqlens"], positions=batch["positions"], max_len=max_len,
                            attention=impl)
        drafter = model.module if hasattr(model, "module") else model
        return packed_ttt_loss(step_hidden, drafter, teacher, batch["loss_mask"], batch["sample_end"], cfg.loss_decay,
                               cfg.loss_chunk_tokens, compute_dtype, compiled,
                               static_rows=head_rows if static else None)


# ---------------------------------------------------------------------------------------------
# Static-shape packed rows and the CUDA-graphed training step (training.cuda_graph)
# ---------------------------------------------------------------------------------------------

_GEOMETRY = ("cu_seqlens", "positions", "sample_end")


def static_max_len(cfg: TrainConfig) -> int:
    """The fixed longest segment of a static row (FlashAttention's max_seqlen): max_length, at
    most batch_tokens. Samples are truncated to it, and the padding is cut into pieces of it."""
    return min(cfg.max_length or cfg.batch_tokens, cfg.batch_tokens)


def static_shape(refs: list[SampleRef], cfg: TrainConfig, epochs: int, head_rows: dict | None = None
                 ) -> tuple[int, int]:
    """(segments, head rows) of the static row, from the batches the plan cuts in `epochs` epochs
    (the same rng sequence as `batches_forever`). Segments: entries of cu_seqlens minus one, the
    most samples of any batch plus the padding pieces (too many slack entries cost the flash
    kernel empty blocks, so the plan is counted). Head rows: the most rows of any batch that
    count in the loss (`head_row_counts`, per sample), rounded up to 64; 0 (every row) without
    the counts or when that is the whole row."""
    rng = random.Random(cfg.seed)
    plans = [b for _ in range(max(1, epochs))
             for b in plan_epoch(refs, cfg.batch_tokens, cfg.max_length, rng, packed=True)]
    segments = max(len(b) for b in plans) + math.ceil(cfg.batch_tokens / static_max_len(cfg))
    if head_rows is None:
        return segments, 0
    rows = 64 * math.ceil(max(sum(head_rows[r.path] for r in b) for b in plans) / 64)
    return segments, rows if rows < cfg.batch_tokens else 0


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
           for k, v in batch.items() if k not in META}
    out["cu_seqlens"] = torch.zeros(segments + 1, dtype=torch.int32, device=device)
    out["positions"] = torch.zeros(tokens, dtype=torch.int64, device=device)
    out["sample_end"] = torch.zeros(tokens, dtype=torch.int64, device=device)
    return out


def fill_static(static: dict[str, torch.Tensor], batch: dict[str, torch.Tensor], max_len: int) -> None:
    """Copy a packed batch into the static row, in place: the padding has ids, loss mask and
    features 0 (a segment of its own, never counted)."""
    tokens, segments = static["positions"].shape[0], static["cu_seqlens"].shape[0] - 1
    if set(static) != set(batch) - set(META) | set(_GEOMETRY):
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
    them as always. `head_rows` (`static_shape`): the rows that go through the head, the most
    any batch has (each batch says its own count, checked); 0: every row."""

    def __init__(self, model, target_head, t2d, draft_vocab_size: int, cfg: TrainConfig, device, optimizer,
                 first_batch: dict, segments: int, warmup: int = 3, head_rows: int = 0):
        if device.type != "cuda":
            raise ValueError(f"training.cuda_graph needs a CUDA device (training on {device})")
        self.model, self.optimizer, self.cfg, self.head_rows = model, optimizer, cfg, head_rows
        self.max_len = static_max_len(cfg)
        check_head_rows(first_batch, head_rows)
        self.static = static_buffers(first_batch, cfg.batch_tokens, segments, device)
        fill_static(self.static, first_batch, self.max_len)
        self.lr = optimizer.param_groups[0]["lr"]
        if not (torch.is_tensor(self.lr) and self.lr.device.type == device.type and optimizer.param_groups[0]["capturable"]):
            raise ValueError("GraphedStep needs an AdamW with capturable=True and lr a device tensor (graph_optimizer)")

        # Frozen, made once outside the graph. Every tensor the graph reads must outlive it: the
        # graph keeps raw addresses, and a freed block is soon reused by the allocator (this head,
        # once a local of __init__, became garbage after the first allocation: wrong teacher, tau 1.0).
        self.target_head, self.t2d = target_head, t2d
        self.draft_head = target_head[t2d]

        def step():
            loss, losses, tallies = packed_forward_on_device(
                model, self.target_head, self.t2d, draft_vocab_size, self.static, cfg, device, "flash", self.max_len,
                static=True, draft_head=self.draft_head, head_rows=head_rows)
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
        check_head_rows(batch, self.head_rows)
        fill_static(self.static, batch, self.max_len)
        self.lr.fill_(lr)
        self.graph.replay()
        return tuple(x.clone() for x in self.outputs)


def check_head_rows(batch: dict, capacity: int) -> None:
    """A batch fits a static row of `capacity` head rows (0: every row) only when it says it does."""
    if capacity and ("head_rows" not in batch or int(batch["head_rows"]) > capacity):
        rows = int(batch["head_rows"]) if "head_rows" in batch else "an unknown count of"
        raise ValueError(f"a packed row with {rows} rows in the loss does not fit the static row's {capacity} "
                         "(training.cuda_graph)")


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
