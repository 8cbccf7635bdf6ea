"""The packed trainer (one packed row, TTT attention without a score matrix, chunked LM head +
loss) computes today's padded loss and gradients, in float32 on the CPU, and the snapshots
for tau against training time."""

import dataclasses
import random

import pytest
import torch

from eagle3_assets.core.sample_files import quantize_fp8
from eagle3_assets.core.train import TrainConfig, pack_batch, pad_batch, plan_epoch, run_forward
from eagle3_assets_tests.test_drafter import AUX, DRAFT_VOCAB, make_drafter
from eagle3_assets_tests.tiny import TINY_VOCAB

LENGTHS = [9, 23, 4, 16, 2, 11]  # different lengths, one shorter than the TTT shift


def make_samples(teacher: str, fp8: bool, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    samples = []
    for n in LENGTHS:
        s = {"input_ids": torch.randint(0, TINY_VOCAB, (n,), dtype=torch.int32),
             "loss_mask": (torch.rand(n) > 0.25).to(torch.uint8)}
        aux = torch.randn(n, 3 * 64)
        if fp8:
            s["aux_hidden_states"], s["aux_scales"] = quantize_fp8(aux, 3)
        else:
            s["aux_hidden_states"] = aux
        if teacher == "last_hidden":
            last = torch.randn(n, 64) * 3
            if fp8:
                s["last_hidden_state"], s["last_scale"] = quantize_fp8(last, 1)
            else:
                s["last_hidden_state"] = last
        else:
            k = 5
            s["topk_ids"] = torch.stack([torch.randperm(DRAFT_VOCAB)[:k] for _ in range(n)]).to(torch.uint16)
            s["topk_logprobs"] = torch.log_softmax(torch.randn(n, k) * 2, -1).sort(-1, descending=True)[0].half()
            s["target_in_draft"] = (torch.rand(n) > 0.2).to(torch.uint8)
        samples.append(s)
    return samples


def loss_and_grads(model, lm_head, samples, attention: str, **cfg):
    cfg = TrainConfig(ttt_steps=4, loss_decay=0.8, attention=attention, **cfg)
    batch = pad_batch(samples) if attention == "padded" else pack_batch(samples)
    model.zero_grad(set_to_none=True)
    loss, losses, tallies = run_forward(model, lm_head, model.t2d, DRAFT_VOCAB, batch, cfg, torch.device("cpu"))
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return loss.item(), torch.stack(losses), tallies, grads


def sharp_drafter():
    """A tiny drafter whose attention is far from uniform (q/k weights scaled up), so the loss is
    far from flat."""
    model = make_drafter().train()
    with torch.no_grad():
        model.midlayer.self_attn.q_proj.weight.mul_(8)
        model.midlayer.self_attn.k_proj.weight.mul_(8)
    return model


@pytest.mark.parametrize("teacher,fp8", [("last_hidden", False), ("topk", False), ("last_hidden", True)])
def test_packed_loss_and_gradients_equal_the_padded_path_in_float32(teacher, fp8):
    model = sharp_drafter()
    lm_head = torch.randn(TINY_VOCAB, 64)
    samples = make_samples(teacher, fp8)
    old = loss_and_grads(model, lm_head, samples, "padded")
    # A small loss chunk: several chunks per step, the teacher's rows shifted across chunk bounds.
    new = loss_and_grads(model, lm_head, samples, "math", loss_chunk_tokens=13)
    assert new[0] == pytest.approx(old[0], rel=1e-5, abs=1e-5)
    assert torch.allclose(new[1], old[1], rtol=1e-5, atol=1e-5)
    assert torch.equal(new[2], old[2]) and int(old[2][:, 1].sum()) > 0
    for name, g in old[3].items():
        assert g.abs().max() > 0, name  # every parameter takes part
        assert torch.allclose(new[3][name], g, rtol=1e-5, atol=1e-5), (name, (new[3][name] - g).abs().max())


def test_the_fused_pointwise_math_traces_whole_and_gives_the_same_loss_and_gradients():
    """training.compile's elementwise math (RMSNorm, RoPE, the SiLU gate, the TTT diagonal merge
    and its backward) compiles as one graph each (fullgraph: a break is an error) and gives the
    eager loss and gradients, in float32 through the aot_eager backend (the trace, no codegen)."""
    from eagle3_assets.core import drafter

    model, lm_head = sharp_drafter(), torch.randn(TINY_VOCAB, 64)
    samples = make_samples("last_hidden", False)
    old = loss_and_grads(model, lm_head, samples, "math", loss_chunk_tokens=13)
    with drafter.fused_pointwise(True, backend="aot_eager"):
        assert drafter._ops["diag_merge_step"] is not drafter.diag_merge_step
        new = loss_and_grads(model, lm_head, samples, "math", loss_chunk_tokens=13)
    assert drafter._ops["diag_merge_step"] is drafter.diag_merge_step  # put back after the block
    assert new[0] == pytest.approx(old[0], rel=1e-5, abs=1e-5)
    assert torch.equal(new[2], old[2])
    for name, g in old[3].items():
        assert torch.allclose(new[3][name], g, rtol=1e-5, atol=1e-5), (name, (new[3][name] - g).abs().max())


def test_packed_plan_fills_batches_by_real_tokens():
    import random

    @dataclasses.dataclass
    class Ref:
        tokens: int

    refs = [Ref(n) for n in [5, 40, 17, 3, 90, 22, 8, 64, 31, 12] * 3]
    batches = plan_epoch(refs, batch_tokens=100, max_length=70, rng=random.Random(0), packed=True)
    assert sorted(id(r) for b in batches for r in b) == sorted(id(r) for r in refs)
    sizes = [sum(min(r.tokens, 70) for r in b) for b in batches]
    assert all(s <= 100 for s in sizes)
    # a batch is closed only when the next sample would not fit
    assert all(sizes[i] + min(batches[i + 1][0].tokens, 70) > 100 for i in range(len(batches) - 1))


def test_snapshots_are_written_once_when_training_time_passes_them(tiny_target, tmp_path):
    from eagle3_assets.core.drafter import load_checkpoint
    from eagle3_assets.core.train import TrainJob, train_drafter
    from eagle3_assets_tests.test_train_job import setup

    params = setup(tiny_target, tmp_path)
    cfg = TrainConfig(max_steps=3, batch_tokens=128, warmup_steps=1, ttt_steps=2, log_every=1000,
                      snapshot_at_s=[1e6, 0.001], checkpoint_dtype="float32")
    state = tmp_path / "state.pt"
    # A run paused after its first step (its slot is 0 s), then the run that finishes it.
    first = train_drafter(TrainJob(**params, config=cfg, state_path=str(state), stop_after_s=0.0), log=lambda m: None)
    assert first["paused"] and first["steps"] == 1
    [snap] = first["snapshots"]
    path = tmp_path / "drafter" / "snapshots" / "t00000.001"
    assert snap["path"] == str(path) and snap["step"] == 1 and snap["train_s"] >= 0.001
    written = (path / "model.safetensors").stat().st_mtime_ns
    model = load_checkpoint(path, torch.zeros(256, 64))
    assert model.config.draft_vocab_size == 64
    second = train_drafter(TrainJob(**params, config=cfg, state_path=str(state)), log=lambda m: None)
    assert second["steps"] == 3 and second["snapshots"] == first["snapshots"]  # kept in the state, not rewritten
    assert (path / "model.safetensors").stat().st_mtime_ns == written
    assert [p.name for p in (tmp_path / "drafter" / "snapshots").iterdir()] == ["t00000.001"]


@pytest.mark.parametrize("ends_by", ["max_steps", "time_budget"])
def test_a_finished_training_whose_result_was_not_recorded_finishes_at_once_on_the_next_run(tiny_target, tmp_path,
                                                                                            ends_by):
    """The state of a finished training stays until the drafter asset has recorded its result
    (`finish_state`): a run stopped in between (on the H100 a SIGTERM 3 s after a 494 s training
    had saved its drafter) finishes at once on the next run, same weights, where it used to
    train again from step 0. After `finish_state`, the next run trains afresh."""
    from eagle3_assets.core.train import TrainJob, finish_state, train_drafter
    from eagle3_assets_tests.test_train_job import setup

    params = setup(tiny_target, tmp_path)
    cfg = TrainConfig(max_steps=3 if ends_by == "max_steps" else 10_000, batch_tokens=128, warmup_steps=1,
                      ttt_steps=2, log_every=1, checkpoint_dtype="float32",
                      time_budget_s=None if ends_by == "max_steps" else 0.5)
    state = tmp_path / "state.pt"
    first = train_drafter(TrainJob(**params, config=cfg, state_path=str(state)), log=lambda m: None)
    assert first["stopped"] == ends_by and first["steps"] >= 1 and state.is_file()
    weights = (tmp_path / "drafter" / "model.safetensors").read_bytes()
    logs = []
    again = train_drafter(TrainJob(**params, config=cfg, state_path=str(state)), log=logs.append)
    assert again["stopped"] == ends_by and again["steps"] == first["steps"]
    assert again["resumed_from_step"] == first["steps"] and again["preload_s"] == 0.0
    assert not any(m.startswith("step ") for m in logs), logs  # no training step ran
    assert again["step_accuracy"] == first["curve"][-1]["accuracy"]
    assert (tmp_path / "drafter" / "model.safetensors").read_bytes() == weights
    finish_state(state)
    assert not state.exists()
    fresh = train_drafter(TrainJob(**params, config=cfg, state_path=str(state)), log=lambda m: None)
    assert fresh["resumed_from_step"] == 0 and fresh["steps"] >= 1


def ttt_attention_and_grads(impl: str, q, k, v, diag, lengths):
    from eagle3_assets.core.drafter import PackedGeometry, TTTAttention

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=q.device)
    inputs = [x.detach().clone().requires_grad_(True) for x in (q, k, v, *diag)]
    out = TTTAttention.apply(inputs[0], inputs[1], inputs[2], PackedGeometry(cu, max(lengths), impl), 0.125, *inputs[3:])
    torch.manual_seed(5)
    out.backward(torch.randn_like(out))
    return [out.float()] + [x.grad.float() for x in inputs]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention varlen needs CUDA")
@pytest.mark.parametrize("steps", [0, 3])
def test_flash_ttt_attention_equals_the_math_path_on_cuda(steps):
    """The FlashAttention varlen prefix with the merged out/lse in its backward gives the float32
    reference's output and gradients, to bf16 rounding (GQA: 9 heads on 3 key-value heads)."""
    torch.manual_seed(0)
    lengths, H, Hk, D = [300, 17, 1, 130, 64], 9, 3, 64
    N = sum(lengths)
    q, k, v = (torch.randn(N, h, D, device="cuda", dtype=torch.bfloat16) for h in (H, Hk, Hk))
    diag = [torch.randn(N, Hk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2 * steps)]
    from eagle3_assets.core import drafter

    flash = ttt_attention_and_grads("flash", q, k, v, diag, lengths)
    assert drafter._Flash.ok, "the FlashAttention ops failed (the math path stood in)"
    math = ttt_attention_and_grads("math", q, k, v, diag, lengths)
    for name, a, b in zip(["out", "dq", "dk", "dv"] + [f"diag{i}" for i in range(2 * steps)], flash, math):
        assert (a - b).norm() <= 2e-2 * b.norm(), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention varlen needs CUDA")
@pytest.mark.parametrize("compile", [False, True])
def test_flash_training_step_matches_the_padded_path_on_cuda(compile):
    """The CUDA path (bf16 autocast, flash prefix, optionally the compiled loss math) against the
    padded path on the same samples: equal to bf16 rounding."""
    model = make_drafter().train().cuda()
    lm_head = torch.randn(TINY_VOCAB, 64).cuda()
    samples = [{k: v.cuda() for k, v in s.items()} for s in make_samples("last_hidden", False)]

    def run(attention, **cfg):
        cfg = TrainConfig(ttt_steps=4, attention=attention, **cfg)
        batch = pad_batch(samples) if attention == "padded" else pack_batch(samples)
        model.zero_grad(set_to_none=True)
        loss, _, tallies = run_forward(model, lm_head, model.t2d, DRAFT_VOCAB, batch, cfg, torch.device("cuda"))
        loss.backward()
        return loss.item(), tallies, torch.cat([p.grad.flatten() for p in model.parameters()])

    old, new = run("padded"), run("flash", compile=compile, loss_chunk_tokens=16)
    assert new[0] == pytest.approx(old[0], rel=2e-2)
    assert torch.equal(new[1][:, 1], old[1][:, 1])  # the same positions counted
    assert (new[2] - old[2]).norm() <= 5e-2 * old[2].norm()


def test_flash_log_sum_exp_layouts_round_trip():
    """Older FlashAttention builds return the varlen log-sum-exp padded per sample [B, H, max]:
    it is read as [H, N] and the merged one written back in the same layout."""
    from eagle3_assets.core.drafter import PackedGeometry, _flash_lse_like, _flash_lse_unpadded

    geo = PackedGeometry(torch.tensor([0, 3, 4, 9]), 5, "flash")
    merged = torch.randn(2, 9)
    assert torch.equal(_flash_lse_like(merged, torch.empty(2, 9), geo), merged)
    padded = _flash_lse_like(merged, torch.empty(3, 2, 5), geo)
    assert torch.equal(padded[1, :, 0], merged[:, 3]) and torch.equal(padded[2, :, 4], merged[:, 8])
    assert torch.equal(_flash_lse_unpadded(padded, geo), merged)


def test_packed_training_is_the_same_from_disk_and_from_preloaded_samples(tiny_target, tmp_path):
    from eagle3_assets.core.train import TrainJob, train_drafter
    from eagle3_assets_tests.test_train_job import setup

    params = setup(tiny_target, tmp_path)
    runs = []
    for preload in (False, True):
        cfg = TrainConfig(max_steps=3, batch_tokens=200, warmup_steps=1, ttt_steps=2, log_every=1, preload=preload)
        runs.append(train_drafter(TrainJob(**{**params, "out_dir": str(tmp_path / f"d{preload}")}, config=cfg),
                                  log=lambda m: None))
    assert runs[0]["attention"] == "math" and runs[0]["steps"] == 3
    assert runs[0]["loss_history"] == runs[1]["loss_history"]
    # packed rows: every batch but an epoch's last holds close to batch_tokens real tokens
    assert runs[0]["tokens_seen"] > 3 * (200 - 40)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a device without the FlashAttention kernel")
def test_flash_falls_back_to_the_math_path_where_the_kernel_fails(monkeypatch):
    from eagle3_assets.core import drafter

    monkeypatch.setattr(drafter._Flash, "ok", True)
    torch.manual_seed(0)
    lengths = [5, 1, 7]
    q, k, v = (torch.randn(13, h, 8) for h in (4, 2, 2))
    diag = [torch.randn(13, 2, 8) for _ in range(4)]
    with pytest.warns(RuntimeWarning, match="falls back to the per-sample math path"):
        fell_back = ttt_attention_and_grads("flash", q, k, v, diag, lengths)
    assert not drafter._Flash.ok
    for a, b in zip(fell_back, ttt_attention_and_grads("math", q, k, v, diag, lengths)):
        assert torch.equal(a, b)


def test_a_snapshot_at_the_time_budget_is_written_with_the_final_weights(tiny_target, tmp_path):
    from eagle3_assets.core.train import TrainJob, train_drafter
    from eagle3_assets_tests.test_train_job import setup

    params = setup(tiny_target, tmp_path)
    # Whether the budget is passed before a step's own snapshot check or only at the loop's next
    # stop check (then the run's end writes it), the snapshot holds the last step's weights.
    cfg = TrainConfig(max_steps=1000, batch_tokens=128, warmup_steps=1, ttt_steps=2, log_every=1000,
                      time_budget_s=0.05, snapshot_at_s=[0.05])
    result = train_drafter(TrainJob(**params, config=cfg), log=lambda m: None)
    assert result["stopped"] == "time_budget"
    [snap] = result["snapshots"]
    assert snap["step"] == result["steps"] and (tmp_path / "drafter" / "snapshots" / "t00000.050").is_dir()


def static_loss_and_grads(model, lm_head, samples, tokens: int, segments: int, head_rows: int = 0, **cfg):
    """`loss_and_grads` on the static row of the CUDA-graph step (run eagerly, math attention),
    `head_rows` rows through the head (0: every row)."""
    from eagle3_assets.core.train import fill_static, packed_forward_on_device, static_buffers, static_max_len

    cfg = TrainConfig(ttt_steps=4, loss_decay=0.8, attention="math", batch_tokens=tokens, **cfg)
    batch = pack_batch(samples)
    static = static_buffers(batch, tokens, segments, torch.device("cpu"))
    fill_static(static, batch, static_max_len(cfg))
    model.zero_grad(set_to_none=True)
    loss, losses, tallies = packed_forward_on_device(model, lm_head, model.t2d, DRAFT_VOCAB, static, cfg,
                                                     torch.device("cpu"), "math", static_max_len(cfg), static=True,
                                                     head_rows=head_rows)
    loss.backward()
    return loss.item(), torch.stack(losses), tallies, {n: p.grad.clone() for n, p in model.named_parameters()}, static


@pytest.mark.parametrize("teacher,fp8,max_length,cut", [("last_hidden", False, None, 0), ("topk", False, 23, 0),
                                                        ("last_hidden", True, 23, 5)])
@pytest.mark.parametrize("head_slack", [None, 0, 7])
def test_the_static_row_of_the_cuda_graph_step_gives_the_packed_loss_and_gradients(teacher, fp8, max_length, cut,
                                                                                   head_slack):
    """A row padded to batch_tokens (a padding segment, cut in pieces of max_len, and zero-length
    segments in cu_seqlens) trains exactly like the dynamic packed row; `cut` > 0: batch_tokens
    ends inside the last sample, which then counts as truncated there. `head_slack`: None, every
    row through the head; else a fixed count of head rows, the row's own count plus that slack."""
    from eagle3_assets.core.train import head_row_counts

    model = sharp_drafter()
    lm_head = torch.randn(TINY_VOCAB, 64)
    samples = make_samples(teacher, fp8)
    real = sum(LENGTHS)
    tokens = real - cut if cut else real + 30
    if cut:  # the dynamic reference: the last sample truncated by hand
        samples = samples[:-1] + [{k: v[: LENGTHS[-1] - cut] for k, v in samples[-1].items()}]
    old = loss_and_grads(model, lm_head, samples, "math", loss_chunk_tokens=13)
    segments = len(LENGTHS) + 2 + 3  # 3 slack entries of length 0
    head_rows = 0
    if head_slack is not None:
        counted = sum(head_row_counts(dict(enumerate(samples)), 4).values())
        assert 0 < counted < 0.9 * real  # prompt rows and last rows stay out
        head_rows = counted + head_slack
    new = static_loss_and_grads(model, lm_head, make_samples(teacher, fp8), tokens, segments, head_rows=head_rows,
                                loss_chunk_tokens=13, max_length=max_length)
    cu = new[4]["cu_seqlens"].tolist()
    assert len(cu) == segments + 1 and cu[-1] == tokens and cu[-1] == cu[-2]  # zero-length entries at the end
    if max_length and not cut:
        assert [b - a for a, b in zip(cu, cu[1:])][len(LENGTHS):len(LENGTHS) + 2] == [23, 7]  # the padding, in pieces
    assert new[0] == pytest.approx(old[0], rel=1e-6, abs=1e-6)
    assert torch.allclose(new[1], old[1], rtol=1e-6, atol=1e-6)
    assert torch.equal(new[2], old[2]) and int(old[2][:, 1].sum()) > 0
    for name, g in old[3].items():
        assert torch.allclose(new[3][name], g, rtol=1e-6, atol=1e-6), (name, (new[3][name] - g).abs().max())


def test_static_row_lengths_and_a_row_with_too_many_samples():
    from eagle3_assets.core.train import static_lengths

    got = static_lengths(torch.tensor([5, 9, 4]), tokens=30, segments=7, max_len=9)
    assert got.tolist() == [5, 9, 4, 9, 3, 0, 0]
    assert static_lengths(torch.tensor([5, 9, 4]), tokens=12, segments=3, max_len=9).tolist() == [5, 7, 0]
    with pytest.raises(ValueError, match="more than the static row's 4"):
        static_lengths(torch.tensor([5, 9, 4]), tokens=40, segments=4, max_len=9)


def test_head_rows_are_counted_per_sample_and_planned_for_the_static_row():
    """`head_row_counts` (all samples as one packed row) gives each sample's own count of rows in
    the loss; `_static_rows` lists them in a fixed tensor; `static_shape` takes the most of any
    planned batch, rounded up to 64; a batch past the static row's count is a clear error."""
    from eagle3_assets.core.train import check_head_rows, counted_rows, head_row_counts, static_shape
    from eagle3_assets.core.train.loss import _static_rows

    samples = make_samples("last_hidden", False)
    cache = dict(enumerate(samples))
    counts = head_row_counts(cache, 3)
    for i, s in cache.items():  # one sample alone: its rows, its end
        n = s["loss_mask"].shape[0]
        alone = torch.stack(counted_rows(s["loss_mask"], torch.full((n,), n), 3)).any(0)
        assert counts[i] == int(alone.sum())
    assert counts[4] == 0  # 2 tokens: no row has a next-next token in its sample

    union = torch.tensor([0, 1, 1, 0, 0, 1, 0, 1], dtype=torch.bool)
    assert _static_rows(union, 6).tolist() == [1, 2, 5, 7, 7, 7]  # padded with the last row
    assert _static_rows(union, 3).tolist() == [1, 2, 5]  # past the capacity: dropped

    @dataclasses.dataclass
    class Ref:
        path: int
        tokens: int

    refs = [Ref(i, n) for i, n in enumerate(LENGTHS)] * 40
    third = {r.path: r.tokens // 3 for r in refs}
    cfg = TrainConfig(batch_tokens=1024, max_length=64)
    segments, rows = static_shape(refs, cfg, 2, third)
    rng = random.Random(cfg.seed)  # the plans of two epochs, as static_shape cuts them
    plans = [b for _ in range(2) for b in plan_epoch(refs, 1024, 64, rng, packed=True)]
    assert segments == max(len(b) for b in plans) + 1024 // 64
    most = max(sum(third[r.path] for r in b) for b in plans)
    assert rows % 64 == 0 and most <= rows < most + 64
    assert static_shape(refs, cfg, 2)[1] == 0  # no counts: every row
    assert static_shape(refs, cfg, 2, {r.path: r.tokens for r in refs})[1] == 0  # the whole row: every row

    check_head_rows({"head_rows": torch.tensor(64)}, 64)
    check_head_rows({}, 0)
    with pytest.raises(ValueError, match="65 rows in the loss does not fit the static row's 64"):
        check_head_rows({"head_rows": torch.tensor(65)}, 64)
    with pytest.raises(ValueError, match="unknown count"):
        check_head_rows({}, 64)


def test_cuda_graph_without_cuda_is_a_clear_error(tiny_target, tmp_path):
    from eagle3_assets.core.train import TrainJob, check_cuda_graph, train_drafter
    from eagle3_assets_tests.test_train_job import setup

    params = setup(tiny_target, tmp_path)
    cfg = TrainConfig(max_steps=1, batch_tokens=128, ttt_steps=2, cuda_graph=True, device="cpu")
    with pytest.raises(ValueError, match="training.cuda_graph needs a CUDA device"):
        train_drafter(TrainJob(**params, config=cfg), log=lambda m: None)
    with pytest.raises(ValueError, match="needs the packed flash attention"):
        check_cuda_graph(TrainConfig(attention="padded"), "padded", torch.device("cuda"), 1)
    with pytest.raises(ValueError, match="one process"):
        check_cuda_graph(TrainConfig(), "flash", torch.device("cuda"), 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("head_rows", [False, True])
def test_cuda_graph_replays_equal_the_eager_static_steps_on_cuda(head_rows):
    """Each replay of the captured step (forward, loss, backward, clip, capturable AdamW with the
    lr a device tensor) against one eager step from the same weights and optimizer state, on rows
    of different sample bounds: the same loss, gradient norm and update, to bf16 rounding. The
    capture's warm-up leaves the weights and optimizer state as they were.

    Each pair starts from one state (the eager one, copied in place into the graph's tensors):
    run apart, the two would drift, as cuBLAS picks other kernels under capture (bf16 rounding
    differs) and Adam's first steps move every weight by about lr whatever its gradient's size,
    which turns that rounding into a different trajectory on a model this small."""
    from eagle3_assets.core.train import (GraphedStep, fill_static, graph_optimizer, head_row_counts,
                                          packed_forward_on_device, run_backward_and_update, static_buffers,
                                          static_max_len)

    device = torch.device("cuda")
    cfg = TrainConfig(ttt_steps=3, batch_tokens=96, max_length=32, cuda_graph=True, loss_chunk_tokens=40)
    lm_head = torch.randn(TINY_VOCAB, 64, device=device)
    samples = [{k: v[:32].cuda() for k, v in s.items()} for s in make_samples("last_hidden", False)]
    batches = [pack_batch(samples[i : i + 4]) for i in range(3)]  # other lengths, other bounds
    segments = 4 + 3 + 2
    capacity = 0
    if head_rows:  # only the rows in the loss through the head, as training does
        counts = head_row_counts(dict(enumerate(samples)), cfg.ttt_steps)
        for i, batch in enumerate(batches):
            batch["head_rows"] = torch.tensor(sum(counts[j] for j in range(i, i + 4)))
        capacity = max(int(b["head_rows"]) for b in batches) + 3

    eager = make_drafter().train().to(device)
    graphed_model = make_drafter().train().to(device)
    before = {k: v.clone() for k, v in graphed_model.state_dict().items()}
    optimizer = graph_optimizer(graphed_model, cfg, device)
    step = GraphedStep(graphed_model, lm_head, graphed_model.t2d, DRAFT_VOCAB, cfg, device, optimizer, batches[0],
                       segments, head_rows=capacity)
    for k, v in graphed_model.state_dict().items():
        assert torch.equal(v, before[k]), k  # the warm-up steps are undone
    assert all(float(s["step"]) == 0 for s in optimizer.state.values())

    eager_opt = graph_optimizer(eager, cfg, device)
    static = static_buffers(batches[0], cfg.batch_tokens, segments, device)

    def eager_step(batch, lr):
        fill_static(static, batch, static_max_len(cfg))
        loss, _, tallies = packed_forward_on_device(eager, lm_head, eager.t2d, DRAFT_VOCAB, static, cfg, device,
                                                    "flash", static_max_len(cfg), static=True, head_rows=capacity)
        eager_opt.param_groups[0]["lr"].fill_(lr)
        return loss.detach(), tallies, run_backward_and_update(loss, eager, eager_opt, eager_opt.param_groups[0]["lr"],
                                                               cfg)

    eager_step(batches[0], 1e-3)  # Adam's moments warm, so that an update follows its gradient
    for batch, lr in zip(batches * 2, [1e-3, 2e-3, 1.5e-3, 1e-3, 5e-4, 1e-3]):
        with torch.no_grad():  # the graph's tensors take the eager state, in place
            for a, b in zip(eager.parameters(), graphed_model.parameters()):
                b.copy_(a)
            for a, b in zip(eager.parameters(), graphed_model.parameters()):
                for key, value in eager_opt.state[a].items():
                    optimizer.state[b][key].copy_(value)
        start = [p.detach().clone() for p in eager.parameters()]
        loss, tallies, norm = eager_step(batch, lr)
        g_loss, _, g_tallies, g_norm = step(batch, lr)
        assert float(g_loss) == pytest.approx(loss.item(), rel=1e-2)
        assert float(g_norm) == pytest.approx(float(norm), rel=3e-2)
        assert torch.equal(g_tallies[:, 1], tallies[:, 1])
        for (name, a), b, s0 in zip(eager.named_parameters(), graphed_model.parameters(), start):
            moved = (a - s0).norm()
            assert moved > 0, name  # trained
            assert ((b - s0) - (a - s0)).norm() <= 0.1 * moved, name  # the same update


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("compile", [False, True])
def test_train_drafter_with_the_cuda_graph_follows_the_eager_run_and_resumes_on_cuda(tiny_target, tmp_path, compile):
    """The whole trainer as `eagle3 run` drives it (training.cuda_graph, with and without
    training.compile): a run paused after its first step and resumed (a new capture over the
    loaded capturable state) trains on the eager run's batches in its order and saves a
    checkpoint. The lr is small, so that the per-step losses show the batches and the schedule
    rather than the bf16 drift between two runs (test above)."""
    from eagle3_assets.core.train import TrainJob, train_drafter
    from eagle3_assets_tests.test_train_job import setup

    params = setup(tiny_target, tmp_path)
    base = dict(max_steps=12, batch_tokens=256, max_length=64, warmup_steps=2, ttt_steps=3, log_every=1, lr=1e-5,
                compile=compile, device="cuda")
    eager = train_drafter(TrainJob(**{**params, "out_dir": str(tmp_path / "eager")}, config=TrainConfig(**base)),
                          log=print)
    graph_job = dict(**{**params, "out_dir": str(tmp_path / "graph")}, config=TrainConfig(**base, cuda_graph=True),
                     state_path=str(tmp_path / "graph_state.pt"))
    first = train_drafter(TrainJob(**graph_job, stop_after_s=0.0), log=print)
    assert first["paused"] and 1 <= first["steps"] < 12
    graphed = train_drafter(TrainJob(**graph_job), log=print)
    assert graphed["steps"] == eager["steps"] == 12
    print("eager losses", eager["loss_history"], "graph losses", graphed["loss_history"], sep="\n")
    assert graphed["loss_history"] == pytest.approx(eager["loss_history"], rel=2e-2)
    assert (tmp_path / "graph" / "model.safetensors").is_file()


@pytest.mark.parametrize("teacher", ["last_hidden", "topk"])
@pytest.mark.parametrize("head_rows", [0, 40])
def test_the_static_step_has_no_data_dependent_shape_or_host_read(teacher, head_rows):
    """What a CUDA graph cannot hold, caught on the CPU: every op of the static step's forward,
    loss, backward and grad clip (the prefix attention aside: flash on CUDA, the host-read
    math path here) is recorded, and none reads a value back or sizes its output by the data."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from eagle3_assets.core import drafter
    from eagle3_assets.core.train import fill_static, packed_forward_on_device, static_buffers

    bad = {"aten::nonzero", "aten::_local_scalar_dense", "aten::masked_select", "aten::unique_dim",
           "aten::_unique2", "aten::repeat_interleave"}
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name
            if name in bad or (name == "aten::index" and any(
                    i is not None and i.dtype == torch.bool for i in args[1])):
                seen.append(name)
            return func(*args, **(kwargs or {}))

    model = make_drafter().train()
    lm_head = torch.randn(TINY_VOCAB, 64)
    cfg = TrainConfig(ttt_steps=3, attention="math", batch_tokens=90, max_length=23, loss_chunk_tokens=32)
    batch = pack_batch(make_samples(teacher, False))
    static = static_buffers(batch, 90, 12, torch.device("cpu"))
    fill_static(static, batch, 23)
    draft_head = lm_head[model.t2d]
    prefix = (drafter._math_prefix_forward, drafter._math_prefix_backward)

    def unrecorded(f):
        def run(*a, **k):
            with torch.utils._python_dispatch._disable_current_modes():
                return f(*a, **k)
        return run

    drafter._math_prefix_forward, drafter._math_prefix_backward = (unrecorded(f) for f in prefix)
    try:
        with Record():
            loss, _, _ = packed_forward_on_device(model, lm_head, model.t2d, DRAFT_VOCAB, static, cfg,
                                                  torch.device("cpu"), "math", 23, static=True, draft_head=draft_head,
                                                  head_rows=head_rows)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    finally:
        drafter._math_prefix_forward, drafter._math_prefix_backward = prefix
    assert seen == []
    with Record():  # the test can fail: the dynamic path selects its rows by nonzero()
        packed_forward_on_device(model, lm_head, model.t2d, DRAFT_VOCAB, static, cfg, torch.device("cpu"), "math", 23,
                                 draft_head=draft_head)
    assert "aten::nonzero" in seen


def test_a_state_saved_without_the_graph_loads_into_the_capturable_optimizer():
    from eagle3_assets.core.train import make_graph_capturable

    model = torch.nn.Linear(3, 2)
    eager = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model(torch.randn(4, 3)).sum().backward()
    eager.step()
    resumed = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1.0), capturable=False)
    resumed.load_state_dict(eager.state_dict())
    make_graph_capturable(resumed, torch.device("cpu"))
    group = resumed.param_groups[0]
    assert group["capturable"] and torch.is_tensor(group["lr"]) and float(group["lr"]) == pytest.approx(3e-4)
    assert all(s["step"].dtype == torch.float32 and float(s["step"]) == 1 for s in resumed.state.values())


@pytest.mark.parametrize("teacher_kind", ["logits", "probs"])
def test_the_one_pass_chunked_loss_gives_autograd_s_loss_and_gradients(teacher_kind, monkeypatch):
    """ChunkedSoftCrossEntropy (the row sums and dz from one function per chunk, dweight
    accumulated by GEMM) against plain autograd of sum w * (logsumexp(z) - sum(p * z)) in
    float32, eager and through the compile path (aot_eager backend: the trace, no codegen)."""
    from eagle3_assets.core.train import loss as loss_module

    torch.manual_seed(0)
    N, H, V = 37, 16, 29
    hidden, weight = torch.randn(N, H, requires_grad=True), torch.randn(V, H, requires_grad=True)
    w = torch.rand(N) * (torch.rand(N) > 0.3)
    t_logits = torch.randn(N, V) * 3
    p = torch.softmax(t_logits, -1)
    teacher = (loss_module.PackedTeacher(torch.ones(N, dtype=torch.bool), t_logits.argmax(-1), logits=t_logits)
               if teacher_kind == "logits" else
               loss_module.PackedTeacher(torch.ones(N, dtype=torch.bool), p.argmax(-1), topk=(
                   torch.arange(V).expand(N, V), torch.log(p)), draft_vocab_size=V))
    rows = torch.randperm(N)  # each loss row's teacher row: gathered inside the chunk's kernel
    z = hidden @ weight.T
    ref = (w * (torch.logsumexp(z, -1) - (p[rows] * z).sum(-1))).sum()
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    compiled = {name: torch.compile(f, backend="aot_eager", dynamic=True, fullgraph=True)
                for name, f in loss_module._CE_EAGER.items()}
    monkeypatch.setattr(loss_module, "_ce_compiled", compiled)
    for use_compiled in (False, True):
        got, argmax = loss_module.ChunkedSoftCrossEntropy.apply(hidden, weight, w, teacher, rows, 8, use_compiled)
        grads = torch.autograd.grad(got * 2.0, (hidden, weight))
        assert got.item() == pytest.approx(ref.item(), rel=1e-5)
        assert torch.equal(argmax, z.argmax(-1))
        for g, r in zip(grads, ref_grads):
            assert torch.allclose(g, 2.0 * r, rtol=1e-5, atol=1e-5), (g - 2.0 * r).abs().max()


def test_outer_products_accumulate_in_float32_from_bf16():
    from eagle3_assets.core.train.loss import _accumulate_outer

    torch.manual_seed(0)
    a, b = torch.randn(64, 8).bfloat16(), torch.randn(64, 5).bfloat16()
    acc = torch.ones(8, 5)
    _accumulate_outer(acc, a, b)
    assert acc.dtype == torch.float32
    assert torch.allclose(acc, 1 + a.float().T @ b.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("fp8", [False, True])
def test_target_in_draft_made_once_at_preload_gives_the_packed_loss_and_gradients(fp8):
    """`add_target_in_draft` (the full-vocabulary argmax, once per preloaded sample) gives the
    flags each step made from the batch, and the packed loss and gradients are the same."""
    from eagle3_assets.core.train.data import add_target_in_draft

    model, lm_head = sharp_drafter(), torch.randn(TINY_VOCAB, 64)
    samples = make_samples("last_hidden", fp8)
    cache = {i: dict(s) for i, s in enumerate(samples)}
    add_target_in_draft(cache, lm_head, model.t2d, chunk_tokens=5)
    flags = torch.cat([s["target_in_draft"] for s in cache.values()])
    assert flags.dtype == torch.bool and 0 < int(flags.sum()) < flags.numel()  # both kinds of rows occur
    plain = loss_and_grads(model, lm_head, samples, "math", loss_chunk_tokens=13)
    cached = loss_and_grads(model, lm_head, list(cache.values()), "math", loss_chunk_tokens=13)
    assert cached[0] == plain[0] and torch.equal(cached[2], plain[2])
    for name, g in plain[3].items():
        assert torch.equal(cached[3][name], g), name
    flipped = [{**s, "target_in_draft": ~s["target_in_draft"]} for s in cache.values()]
    assert loss_and_grads(model, lm_head, flipped, "math", loss_chunk_tokens=13)[0] != plain[0]  # the flags are read
