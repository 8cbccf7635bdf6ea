"""Train the EAGLE-3 drafter on extracted hidden states (nanoGPT-style: the loop is the code).

Inputs: shard directories in the hidden-state file contract (`sample_files.py`), the target's
folder (its embeddings and lm_head only), and the vocab map. Output: an official EAGLE-3
checkpoint. `train_drafter` reads as a table of contents: set up, build the model, the data
and the optimizer, restore a saved state, then the loop, each step one call to a named helper.

The modules, by concern: `job` (TrainConfig, TrainJob), `data` (plans, packed and padded
batches), `loss` (the teachers, the fused chunked loss), `step` (the forward, backward and
update of one batch, the CUDA-graphed step), `state` (the resumable state), `loop`
(`train_drafter`, the schedule, the stop clock). This package re-exports their names.

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

from ..sample_files import list_samples
from .data import (
    _batch_from_cache,
    add_target_in_draft,
    batches_forever,
    build_data,
    head_row_counts,
    load_batch,
    pack_batch,
    pad_batch,
    plan_epoch,
    plan_steps,
    preload_samples,
)
from .job import TrainConfig, TrainJob
from .loop import (
    StopClock,
    TrainResult,
    _stop_on_sigterm,
    build_draft_model,
    finish_state,
    learning_rate,
    place_draft_model,
    run_training,
    train_drafter,
    write_due_snapshots,
)
from .loss import (
    ChunkedSoftCrossEntropy,
    PackedTeacher,
    counted_rows,
    packed_teacher,
    packed_ttt_loss,
    target_distribution,
    teacher_distribution,
    topk_distribution,
    ttt_loss,
    window_accuracy,
)
from .state import Progress, load_state, state_fingerprint, write_state
from .step import (
    GraphedStep,
    attention_impl,
    check_cuda_graph,
    check_head_rows,
    fill_static,
    graph_optimizer,
    make_graph_capturable,
    packed_forward_on_device,
    packed_geometry,
    run_backward_and_update,
    run_forward,
    run_forward_packed,
    static_buffers,
    static_lengths,
    static_max_len,
    static_shape,
)
