"""The resumable state: what a run has done (`Progress`), saved with the weights and the optimizer,
and the fingerprint that keeps a state from resuming on other data or settings."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from ..files import atomic_path
from ..sample_files import DamagedSampleError, SampleRef
from .job import TrainJob


@dataclass
class Progress:
    """What the run has done so far: saved in the state, reported at the end."""

    step: int = 0
    tokens_seen: int = 0
    loss_history: list[float] = field(default_factory=list)
    curve: list[dict] = field(default_factory=list)  # the logged points: step, time, loss, lr, accuracy
    snapshots: list[dict] = field(default_factory=list)  # the copies written at snapshot_at_s: train_s, step, path


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
