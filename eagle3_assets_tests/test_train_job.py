"""The training job as the `drafter` asset launches it: killed and resumed, and DDP over 2 gloo ranks."""

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from eagle3_assets.core.drafter import load_checkpoint
from eagle3_assets.core.train import TrainConfig, TrainJob
from eagle3_assets.core.vocab import build_vocab_map, count_tokens, save_vocab_map

from .tiny import write_hidden_state_shard


def setup(tiny_target: Path, tmp_path: Path) -> dict:
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(24):
        t = int(torch.randint(10, 40, (1,), generator=g))
        ids = torch.randint(5, 256, (t,), generator=g).tolist()
        samples.append((ids, [0] * 4 + [1] * (t - 4)))
    shard = write_hidden_state_shard(tiny_target, tmp_path / "shard", samples, aux_layer_ids=[2, 3, 3 + 1])
    d2t, t2d = build_vocab_map(count_tokens(samples, 256), 64)
    save_vocab_map(tmp_path / "vocab.safetensors", d2t, t2d, {})
    return {
        "shard_dirs": [str(shard)], "target_model_dir": str(tiny_target),
        "vocab_map_path": str(tmp_path / "vocab.safetensors"), "out_dir": str(tmp_path / "drafter"),
        "aux_layer_ids": [2, 3, 4], "draft_vocab_size": 64,
    }


def job(params: dict, cfg: TrainConfig, nproc: int = 1, state_path=None, stop_after_s=None, **popen) -> subprocess.Popen:
    train = TrainJob(**params, config=cfg, state_path=state_path and str(state_path), stop_after_s=stop_after_s)
    env = {**os.environ, "EAGLE3_JOB_PARAMS": json.dumps(asdict(train)), "OMP_NUM_THREADS": "1"}
    mod = ["-m", "eagle3_assets.entrypoints.train_drafter"]
    cmd = [sys.executable, *mod] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *mod]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def test_killed_training_resumes_from_its_last_state(tiny_target, tmp_path):
    params = setup(tiny_target, tmp_path)
    state = tmp_path / "state" / "train_state.pt"
    cfg = TrainConfig(max_steps=400, batch_tokens=128, warmup_steps=2, lr=1e-3, save_every=10, log_every=10,
                      ttt_steps=3)
    first = job(params, cfg, state_path=state, start_new_session=True)
    deadline = time.time() + 180
    while not state.exists() and time.time() < deadline and first.poll() is None:
        time.sleep(0.05)
    time.sleep(0.5)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    saved = torch.load(state, weights_only=False)["step"]
    assert 10 <= saved < 400, "the state must come from the middle of the run"
    assert not (tmp_path / "drafter" / "model.safetensors").exists()

    second = job(params, cfg, state_path=state)
    out, _ = second.communicate(timeout=600)
    assert second.returncode == 0, out
    assert f"resumed from {state} at step {saved} of 400" in out
    assert state.exists()  # finished: kept until the drafter asset has the result (`finish_state`)
    model = load_checkpoint(tmp_path / "drafter", torch.zeros(256, 64))
    assert model.config.draft_vocab_size == 64


def test_ddp_over_two_gloo_ranks_trains_and_saves_one_checkpoint(tiny_target, tmp_path):
    params = setup(tiny_target, tmp_path)
    cfg = TrainConfig(max_steps=6, batch_tokens=128, warmup_steps=1, ttt_steps=2, log_every=1)
    p = job(params, cfg, nproc=2)
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out
    assert (tmp_path / "drafter" / "model.safetensors").is_file()
    assert "saved drafter" in out


def test_ddp_ranks_pause_together_and_resume(tiny_target, tmp_path):
    """stop_after_s under DDP: both ranks pause at the same step (rank 0's clock decides for
    both), rank 0 keeps the state and fails the job with a message that says so (the drafter is
    not done), and the next run resumes from it on both ranks."""
    params = setup(tiny_target, tmp_path)
    state = tmp_path / "train_state.pt"
    cfg = TrainConfig(max_steps=6, batch_tokens=128, warmup_steps=1, ttt_steps=2, log_every=1)
    p = job(params, cfg, nproc=2, state_path=state, stop_after_s=0.0)
    out, _ = p.communicate(timeout=600)
    assert p.returncode != 0, out
    assert "paused after 1 steps" in out and "training paused after step 1 of 6" in out and state.exists()
    p = job(params, cfg, nproc=2, state_path=state)
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out
    assert f"resumed from {state} at step 1 of 6" in out and torch.load(state, weights_only=False)["step"] == 6


def test_learning_curve_points_are_observed_live_through_pipes(tiny_target, tmp_path):
    """Issue 22, item 13: each point becomes an observation while training runs (real timestamps,
    before the job ends), with loss and top-1 as numbers and step and time as text (not metrics)."""
    import time

    from dagster import AssetExecutionContext, AssetKey, AssetRecordsFilter, DagsterInstance, asset, materialize

    from eagle3_assets.observe import observe_learning_curve
    from eagle3_assets.launchers import GpuJob, LocalLauncher

    params = setup(tiny_target, tmp_path)
    train = TrainJob(**params, config=TrainConfig(max_steps=31, batch_tokens=128, warmup_steps=2, log_every=10))
    ended = []

    @asset(name="drafter")
    def drafter(context: AssetExecutionContext):
        with observe_learning_curve(context):
            result = LocalLauncher({"OMP_NUM_THREADS": "1"}).run(
                context, GpuJob("train-drafter", "eagle3_assets.entrypoints.train_drafter", train)).get_materialize_result()
        ended.append(time.time())
        return result

    with DagsterInstance.ephemeral() as instance:
        assert materialize([drafter], instance=instance).success
        records = instance.fetch_observations(AssetRecordsFilter(asset_key=AssetKey("drafter")), limit=100).records
    points = sorted(records, key=lambda r: r.timestamp)
    meta = [{k: v.value for k, v in r.event_log_entry.asset_observation.metadata.items()} for r in points]
    assert [m["curve_step"] for m in meta] == ["0", "10", "20", "30"]  # text: the UI does not plot it
    assert all(isinstance(m["curve_loss"], float) and isinstance(m["curve_train_s"], str) for m in meta)
    assert all(r.timestamp < ended[0] for r in points)  # logged while the job ran, not after it
    assert len({r.timestamp for r in points}) == len(points)
