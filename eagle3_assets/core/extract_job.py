"""One shard's extraction job, as run by each process (rank) of a launch.

Plain Python: the Pipes entry point (`eagle3_assets.jobs.extract_hidden_states`)
passes it the parameters and a logger, and reports what it returns. Under
`torchrun` every rank loads the model and extracts its share of the shard's rows
(data parallel); rank 0 writes the manifest last and measures the shard.
"""

from __future__ import annotations

import fcntl
import os
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import polars as pl
import torch

from .hidden_states import (
    FORMAT_VERSION,
    MANIFEST,
    DiskProgress,
    bytes_per_token,
    check_free_space,
    extract_samples,
    plan_shard,
    sample_file,
    write_manifest,
)
from .files import bytes_on_disk
from .target import DTYPES, check_aux_layer_ids, load_model, pick_device, resolve_target

HEADER_BYTES_PER_FILE = 1024  # safetensors JSON header + alignment, a generous bound for the space check


@dataclass
class ExtractParams:
    generations_path: str
    shard_dir: str
    model_dir: str
    target_name: str
    aux_layer_ids: list[int] | None = None
    dtype: str = "bfloat16"
    device: str = "auto"
    batch_tokens: int = 16384
    writer_threads: int = 4
    parallel: str = "data"  # "data": rows split between ranks; "tensor": one model sharded over ranks
    progress_every_s: float = 5.0


def _dist() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _init_distributed(device: torch.device) -> None:
    if _dist()[1] > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")


class ShardBusyError(RuntimeError):
    pass


@contextmanager
def shard_lock(shard_dir: Path):
    """One writer per shard: a second run of the same shard refuses instead of interleaving files.
    flock is released by the kernel when the holder dies, so a killed job leaves no stale lock."""
    shard_dir.parent.mkdir(parents=True, exist_ok=True)
    path = shard_dir.parent / f".{shard_dir.name}.lock"
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            raise ShardBusyError(
                f"shard {shard_dir.name} is being extracted by another process ({holder}); "
                "wait for that run to finish or stop it, then rerun"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}")
        f.flush()
        yield


def run_extraction(p: ExtractParams, log: Callable[[str], None] = print) -> dict | None:
    """Extract one shard; returns its metadata on rank 0 (None on other ranks)."""
    if _dist()[0] != 0:
        return _run_extraction(p, log)
    with shard_lock(Path(p.shard_dir)):
        return _run_extraction(p, log)


def _run_extraction(p: ExtractParams, log: Callable[[str], None]) -> dict | None:
    rank, world = _dist()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(p.device)
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    _init_distributed(device)
    shard_dir, dtype = Path(p.shard_dir), DTYPES[p.dtype]

    t0 = time.perf_counter()
    gens = pl.read_parquet(p.generations_path).select("row_id", "input_ids", "loss_mask")
    tensor = p.parallel == "tensor" and world > 1
    model_dir = resolve_target(p.model_dir)  # a clear error for a missing or incomplete model folder
    model = load_model(model_dir, dtype, str(device), base_only=True, tensor_parallel=tensor)
    model_load_s = time.perf_counter() - t0
    cfg = model.config
    aux_ids = check_aux_layer_ids(p.aux_layer_ids, cfg.num_hidden_layers)
    hidden = cfg.hidden_size

    if rank == 0:
        manifest = shard_dir / MANIFEST
        manifest.unlink(missing_ok=True)  # the shard is incomplete until we rewrite it last
    _barrier(world)
    todo, resumed = plan_shard(gens, shard_dir, hidden, dtype) if rank == 0 else (None, None)
    todo, resumed = _broadcast((todo, resumed), world)
    todo_tokens = sum(len(s[1]) for s in todo)
    if rank == 0:
        need = todo_tokens * bytes_per_token(hidden, dtype) + len(todo) * HEADER_BYTES_PER_FILE
        check_free_space(shard_dir, need)
        log(f"shard {shard_dir.name}: {len(gens)} samples, {len(todo)} to extract, {resumed} resumed from valid files")
    # Data parallel: interleave the length-sorted list so every rank gets long and short samples.
    # Tensor parallel: every rank runs every sample (the collectives must match); rank 0 writes.
    mine = todo if tensor else sorted(todo, key=lambda s: len(s[1]), reverse=True)[rank::world]
    meta = {
        "format_version": FORMAT_VERSION,
        "target_model": p.target_name,
        "aux_layer_ids": ",".join(map(str, aux_ids)),
        "dtype": p.dtype,
        "hidden_size": str(hidden),
    }

    stop = threading.Event()
    reporter = None
    if rank == 0:
        progress = DiskProgress(shard_dir, dict(zip(gens["row_id"].to_list(), gens["input_ids"].list.len().to_list())))
        progress.line()  # baseline: what is already on disk
        reporter = threading.Thread(target=_report_every, args=(progress, p.progress_every_s, stop, log), daemon=True)
        reporter.start()
    t1 = time.perf_counter()
    try:
        extract_samples(
            model,
            mine,
            shard_dir,
            aux_layer_ids=aux_ids,
            dtype=dtype,
            batch_tokens=p.batch_tokens,
            writer_threads=p.writer_threads,
            metadata=meta,
            # The lean forward reads whole weight matrices; sharded ones go through the model's own forward.
            lean=False if tensor else None,
            write=rank == 0 or not tensor,
        )
        if device.type == "cuda":
            torch.cuda.synchronize()
        extract_s = time.perf_counter() - t1
    finally:
        stop.set()
        if reporter:
            reporter.join()
    ranks = _gather(
        {"rank": rank, "samples": len(mine), "tokens": sum(len(s[1]) for s in mine), "model_load_s": model_load_s,
         "extract_s": extract_s},
        world,
    )
    if rank != 0:
        return None
    log(progress.line())
    missing = [r for r in gens["row_id"] if not sample_file(shard_dir, r).exists()]
    if missing:
        raise RuntimeError(f"shard {shard_dir.name}: {len(missing)} sample files missing after extraction, e.g. {missing[:5]}")
    manifest_df = write_manifest(shard_dir, gens["row_id"].to_list())
    extract_s = max(r["extract_s"] for r in ranks)
    new_tokens = ranks[0]["tokens"] if tensor else sum(r["tokens"] for r in ranks)
    samples = len(manifest_df)
    return {
        "path": str(shard_dir),
        "samples": samples,
        "tokens": int(manifest_df["tokens"].sum()),
        "tokens_extracted": new_tokens,
        "samples_resumed": resumed,
        "tokens_per_s": new_tokens / extract_s if extract_s > 0 else 0.0,
        "samples_per_s": (samples - resumed) / extract_s if extract_s > 0 else 0.0,
        "model_load_s": max(r["model_load_s"] for r in ranks),
        "extract_s": extract_s,
        "bytes_on_disk": bytes_on_disk(shard_dir),
        "bytes_expected": int(manifest_df["tokens"].sum()) * bytes_per_token(hidden, dtype),
        "aux_layer_ids": aux_ids,
        "dtype": p.dtype,
        "processes": world,
        "parallel": p.parallel if world > 1 else "none",
        "device": str(device.type),
        "hidden_size": hidden,
    }


def _report_every(progress: DiskProgress, every: float, stop: threading.Event, log) -> None:
    while not stop.wait(every):
        log(progress.line())


def _barrier(world: int) -> None:
    if world > 1:
        torch.distributed.barrier()


def _broadcast(obj, world: int):
    if world == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _gather(obj, world: int) -> list:
    if world == 1:
        return [obj]
    out = [None] * world
    torch.distributed.all_gather_object(out, obj)
    return out
