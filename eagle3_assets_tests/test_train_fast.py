"""The packed trainer (one packed row, TTT attention without a score matrix, chunked LM head +
loss) computes today's padded loss and gradients, in float32 on the CPU, and the snapshots
for tau against training time."""

import dataclasses

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


@pytest.mark.parametrize("teacher,fp8", [("last_hidden", False), ("topk", False), ("last_hidden", True)])
def test_packed_loss_and_gradients_equal_the_padded_path_in_float32(teacher, fp8):
    model = make_drafter().train()
    # Scale the weights up so that attention is far from uniform and the loss far from flat.
    with torch.no_grad():
        model.midlayer.self_attn.q_proj.weight.mul_(8)
        model.midlayer.self_attn.k_proj.weight.mul_(8)
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
