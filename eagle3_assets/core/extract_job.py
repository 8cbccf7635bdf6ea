"""The extraction job of one or several shards, as run by each process (rank) of a launch.

Plain Python: the Pipes entry point (`eagle3_assets.entrypoints.extract_hidden_states`) passes it
the shards and a logger, and reports what it returns for each. Under `torchrun` every rank
loads the model and extracts its share of each shard's rows (data parallel), or all ranks
run one model sharded over them (tensor parallel, rank 0 writes; a quantized checkpoint's routed
experts are split between the ranks, the rest whole: expert parallel); rank 0 writes each
manifest last and measures the shard.

Several shards go through one model load (a multi-partition run: a big target loads once,
not once per shard), and each stays its own unit: its own lock, files, manifest, metadata,
and failure (a shard that fails is reported failed, the others carry on).

The job's phases are timed apart, so the throughput figure is the extraction's own:
`cuda_init_s` (the device context), `model_load_s` (weights onto the device), `warmup_s`
(one short forward: kernels and libraries loaded, staging buffers pinned), `extract_s`.
A shard's metadata holds its share of the first three (divided over the shards that needed
the model), so the shares of a run add up to one load.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import socket
import threading
import time
from collections import deque
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

import polars as pl
import torch
from transformers import AutoConfig

from .config import STRICT, PositiveFloat, PositiveInt, from_dict, require
from .distributed import setup
from .stopping import STOP, Stopped
from .extract_engine import TopkTeacher, extract_samples, warm_up
from .layout import Layout
from .lean_forward import attention_path, lean_supported
from .files import bytes_on_disk
from .sample_files import (
    DEFAULT_TOPK,
    MANIFEST,
    MAX_DRAFT_VOCAB,
    SampleLayout,
    check_free_space,
    damaged_files,
    plan_shard,
    sample_file,
    write_manifest,
)
from .target import DTYPES, check_aux_layer_ids, load_model, load_target_head, quantization_of, resolve_target
from .vocab import load_vocab_map, vocab_map_fingerprint


@dataclass(frozen=True)
class ExtractConfig:
    """The `extraction:` section of the settings."""

    __pydantic_config__ = STRICT
    # Hugging Face `hidden_states` convention: 0 = embeddings, j = output of layer j-1.
    # None means the EAGLE-3 default [2, N//2, N-3] for an N-layer target.
    aux_layer_ids: list[int] | None = None
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    device: str = "auto"  # "auto" = cuda when available, else cpu
    batch_tokens: PositiveInt = 16384  # tokens per packed forward
    writer_threads: PositiveInt = 4
    nproc: PositiveInt = 1  # > 1 launches torchrun
    # data: a whole model per rank; tensor: one model over the ranks (transformers' plan, or for a
    # quantized checkpoint its routed experts split between them)
    parallel: Literal["data", "tensor"] = "data"
    progress_every_s: PositiveFloat = 5.0

    # How the hidden states are stored (README, "Storage layouts"): bf16 = in `dtype` (bfloat16
    # unless set otherwise); fp8 = float8 e4m3 with a float32 scale per token and layer,
    # quantized on the device: about half the bytes.
    storage: Literal["bf16", "fp8"] = "bf16"
    # What the drafter learns from: last_hidden = the final-norm hidden state (training applies
    # the lm_head); topk = the target's top-k log-probabilities over the draft vocabulary,
    # computed here, so `vocab_map` is built before `hidden_states`.
    teacher: Literal["last_hidden", "topk"] = "last_hidden"
    # k of the top-k teacher (why 64: `sample_files.DEFAULT_TOPK`); each shard's `topk_mass`
    # metadata says how much of the teacher's probability its files keep.
    topk: PositiveInt = DEFAULT_TOPK

    def __post_init__(self):
        ids = self.aux_layer_ids
        require(ids is None or (len(ids) == 3 and len(set(ids)) == 3),
                f"extraction.aux_layer_ids must be three distinct layer ids, got {ids}")
        require(self.topk <= MAX_DRAFT_VOCAB, f"extraction.topk must be at most {MAX_DRAFT_VOCAB:,} "
                f"(draft ids are stored as uint16), got {self.topk}")


@dataclass(frozen=True)
class ExtractJob:
    """One shard: what it reads and writes, and the extraction config."""

    generations_path: str
    shard_dir: str
    model_dir: str
    target_name: str
    config: ExtractConfig = field(default_factory=ExtractConfig)
    vocab_map_path: str | None = None  # teacher "topk": the draft vocabulary the top-k is taken over
    redo: bool = False  # extract every sample again, valid files or not (`eagle3 run --force`)


def extract_layout(cfg: ExtractConfig, hidden_size: int, draft_vocab: str | None = None) -> SampleLayout:
    """The file layout these settings write (`draft_vocab`: the vocab map's fingerprint, topk only)."""
    return SampleLayout(hidden_size, DTYPES[cfg.dtype], cfg.storage, cfg.teacher, cfg.topk, draft_vocab)


def shard_jobs(paths: Layout, keys: list[str], target_model: str, model_cache_dir: str | None, config: ExtractConfig,
               redo: bool) -> tuple[list[ExtractJob], dict[str, dict]]:
    """The job of each shard of `keys` that has its generations; for each that has none, its error
    (`"final"`: no retry helps)."""
    jobs, errors = [], {}
    for shard in keys:
        if not paths.generations(shard).is_file():
            errors[shard] = {"error": f"no generations for shard {shard} at {paths.generations(shard)}; "
                                      f"materialize generations[{shard}] first", "final": True}
            continue
        jobs.append(ExtractJob(generations_path=str(paths.generations(shard)), shard_dir=str(paths.hidden_states(shard)),
                               model_dir=str(resolve_target(target_model, model_cache_dir)), target_name=target_model,
                               config=config, vocab_map_path=str(paths.vocab_map) if config.teacher == "topk" else None,
                               redo=redo))
    return jobs, errors


def layout_version(cfg: ExtractConfig) -> str:
    """The file layout as a code-version suffix; empty for the default bf16/last_hidden, so files made
    before the layouts existed stay fresh."""
    named = (cfg.storage, cfg.teacher) != ("bf16", "last_hidden")
    return f"-{cfg.storage}-{cfg.teacher}" + (str(cfg.topk) if cfg.teacher == "topk" else "") if named else ""


def load_draft_vocab(cfg: ExtractConfig, vocab_map_path: str | None):
    """(d2t, t2d, fingerprint) of the vocab map the top-k teacher needs; None for last_hidden."""
    if cfg.teacher != "topk":
        return None
    if not vocab_map_path or not Path(vocab_map_path).is_file():
        raise FileNotFoundError(
            f"extraction.teacher: topk stores log-probabilities over the draft vocabulary, so it needs the vocab map, "
            f"not found at {vocab_map_path}; materialize vocab_map first (eagle3 run does it before hidden_states)")
    d2t, t2d = load_vocab_map(vocab_map_path)
    if d2t.numel() > MAX_DRAFT_VOCAB:
        raise ValueError(f"extraction.teacher: topk stores draft ids as uint16, so the draft vocabulary must have at "
                         f"most {MAX_DRAFT_VOCAB:,} tokens; {vocab_map_path} has {d2t.numel():,}")
    if cfg.topk > d2t.numel():
        raise ValueError(f"extraction.topk={cfg.topk} exceeds the draft vocabulary of {vocab_map_path} "
                         f"({d2t.numel():,} tokens)")
    return d2t, t2d, vocab_map_fingerprint(d2t)


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


class DiskProgress:
    """Progress read from the disk: what the files say, never a counter kept on the side.

    Counts the shard's sample files that exist under their final names (so all ranks' work,
    and samples resumed from an earlier run), their tokens and bytes. Made when extraction
    starts (after the model load and warm-up): the rates are the extraction's own.
    """

    def __init__(self, shard_dir: Path, tokens_by_row: dict[int, int]):
        self.shard_dir = shard_dir
        self.tokens_by_name = {sample_file(shard_dir, r).name: t for r, t in tokens_by_row.items()}
        self.total_tokens = sum(tokens_by_row.values())
        self.history: deque[tuple[float, int]] = deque(maxlen=1024)
        self.started = time.perf_counter()
        self.baseline = self.scan()[1]  # resumed samples are not this run's throughput

    def scan(self) -> tuple[int, int, int]:
        done = tokens = nbytes = 0
        with os.scandir(self.shard_dir) as it:
            for e in it:
                t = self.tokens_by_name.get(e.name)
                if t is not None:
                    done += 1
                    tokens += t
                    nbytes += e.stat().st_size
        return done, tokens, nbytes

    def line(self) -> str:
        done, tokens, nbytes = self.scan()
        now = time.perf_counter()
        self.history.append((now, tokens))
        overall = (tokens - self.baseline) / max(now - self.started, 1e-9)
        t0, n0 = next((t, n) for t, n in self.history if now - t <= 10.0)
        window = (tokens - n0) / (now - t0) if now - t0 > 0.5 else overall
        eta = f"{(self.total_tokens - tokens) / overall:,.0f} s" if overall > 0 else "unknown"
        return (
            f"{done}/{len(self.tokens_by_name)} samples, {tokens:,}/{self.total_tokens:,} tokens, "
            f"{window:,.0f} tok/s (last 10 s), {overall:,.0f} tok/s overall, ETA {eta}, "
            f"{nbytes:,} bytes on disk"
        )


@dataclass(frozen=True)
class ExtractShards:
    """Several shards of one target through one model load (a multi-partition run): each shard
    keeps its own files, lock, manifest, metadata and failure; they share the model, its
    config and the extraction config."""

    jobs: list[ExtractJob]

    def __post_init__(self):
        require(len(self.jobs) > 0, "ExtractShards needs at least one shard")
        first = self.jobs[0]
        same = (first.model_dir, first.target_name, first.config, first.vocab_map_path)
        require(all((j.model_dir, j.target_name, j.config, j.vocab_map_path) == same for j in self.jobs),
                "the shards of one extraction must share the target model, the extraction config and the vocab map")

    @classmethod
    def from_json(cls, text: str) -> "ExtractShards":
        """From `{"jobs": [...]}`, or one `ExtractJob`'s JSON (a single shard)."""
        data = json.loads(text)
        return cls([from_dict(ExtractJob, j) for j in data["jobs"]] if "jobs" in data else [from_dict(ExtractJob, data)])


@dataclass
class ShardResult:
    """One shard's extraction, on rank 0: `.metadata()` is the shard's metadata (plain JSON values)."""

    figures: dict

    def metadata(self) -> dict:
        return dict(self.figures)

    def __getitem__(self, key: str):
        return self.figures[key]  # one figure by name, as the callers that read the former dict do


def run_extraction(job: ExtractJob, log: Callable[[str], None] = print) -> ShardResult | None:
    """Extract one shard; returns its result on rank 0 (None on other ranks), raises its error."""
    results: list = []
    extract_shards(ExtractShards([job]), log, lambda job, result: results.append(result))
    if results and isinstance(results[0], BaseException):
        raise results[0]
    return results[0] if results else None


def extract_shards(group: ExtractShards, log: Callable[[str], None], report: Callable[[ExtractJob, object], None]) -> None:
    """Extract every shard of `group` with at most one model load. On rank 0, `report(job, result)`
    is called once per shard, as it finishes, with its `ShardResult` or the exception that failed it;
    a failed shard does not stop the others. What fails them all (the target cannot be read or
    loaded) raises."""
    target = _Target(group.jobs[0], log)
    dist = target.dist
    # Plan every shard first (rank 0: which files are missing or invalid; each shard stays locked
    # until the job ends), so the model is loaded only if some shard has work, and each shard's
    # share of the load is known.
    plans: list[_Plan | BaseException] = []
    with ExitStack() as locks:
        for job in group.jobs:
            plan = _attempt(_plan, job, target, locks, log) if dist.main else None
            shared = dist.broadcast(dataclasses.replace(plan, gens=None) if isinstance(plan, _Plan) and dist.world > 1 else plan)
            plans.append(plan if dist.main else shared)
        working = [p for p in plans if isinstance(p, _Plan) and p.todo]
        # The free space for every shard of the run at once: each alone may fit where all do not.
        full = _attempt(check_free_space, Path(group.jobs[0].shard_dir), sum(p.needed_bytes for p in working),
                        [Path(j.shard_dir).name for j, p in zip(group.jobs, plans) if isinstance(p, _Plan) and p.todo]) \
            if dist.main and working else None
        full = dist.broadcast(full) if dist.world > 1 else full
        if full is not None:
            plans, working = [full if isinstance(p, _Plan) and p.todo else p for p in plans], []
        if working:
            target.load(shards=len(working))
        for job, plan in zip(group.jobs, plans):
            if STOP.is_set() and isinstance(plan, _Plan):
                plan = Stopped(f"stopped before shard {Path(job.shard_dir).name} began")
            result = plan if isinstance(plan, BaseException) else _attempt(_extract, job, plan, target, log)
            if dist.main:
                report(job, result)


def _attempt(fn, *args, **kwargs):
    """fn(...), or the exception it raised: one shard's failure is that shard's result."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 (reported for the shard, with its type and message)
        return e


class _Target:
    """The target of a group of shards: its config and aux layer ids at once, the model (and the
    device's context) loaded at most once, timed, with each shard's share of the set-up."""

    def __init__(self, job: ExtractJob, log: Callable[[str], None]):
        self.config, self.log = job.config, log
        t0 = time.perf_counter()
        self.dist = setup(self.config.device)
        if self.dist.device.type == "cuda":
            torch.cuda.init()
            torch.empty(1, device=self.dist.device)  # the context exists now: the model load does not pay for it
        self.cuda_init_s = time.perf_counter() - t0
        self.dtype = DTYPES[self.config.dtype]
        self.tensor = self.config.parallel == "tensor" and self.dist.world > 1
        self.model_dir = resolve_target(job.model_dir)  # a clear error for a missing or incomplete model folder
        target_config = AutoConfig.from_pretrained(self.model_dir)
        self.aux_ids = check_aux_layer_ids(self.config.aux_layer_ids, target_config.num_hidden_layers)
        self.hidden = target_config.hidden_size
        self.vocab = load_draft_vocab(self.config, job.vocab_map_path)
        self.layout = extract_layout(self.config, self.hidden, self.vocab[2] if self.vocab else None)
        self.writes = self.dist.main or not self.tensor  # tensor parallel: rank 0 writes
        self.teacher = None
        # The lean forward reads whole weight matrices; sharded ones go through the model's own forward.
        # A quantized checkpoint shards its routed experts only (expert parallel), which the lean
        # forward runs (`moe.routed_experts` sums the ranks' shares).
        self.experts_split = self.tensor and quantization_of(self.model_dir) is not None
        self.lean = False if self.tensor and not self.experts_split else None
        self.model, self.model_load_s, self.warmup_s, self.shards = None, 0.0, 0.0, 0

    def load(self, shards: int) -> None:
        t1 = time.perf_counter()
        self.model = load_model(self.model_dir, self.dtype, str(self.dist.device), base_only=True, tensor_parallel=self.tensor)
        if self.vocab and self.writes:  # the base model has no lm_head: read it alone from the checkpoint
            self.teacher = TopkTeacher(load_target_head(self.model_dir)[1], self.vocab[0], self.vocab[1],
                                       self.config.topk, self.dist.device, self.dtype)
        self.model_load_s = time.perf_counter() - t1
        warm_up(self.model, self.aux_ids, self.dtype, self.lean, layout=self.layout if self.writes else None,
                teacher=self.teacher)
        self.warmup_s = time.perf_counter() - t1 - self.model_load_s
        self.shards = shards
        if self.lean is None:
            self.lean = lean_supported(self.model)
        if self.dist.main:
            forward = (f"packed forward, attention {attention_path(self.dist.device, self.dtype)}"
                       + (f" (expert parallel: each of {self.dist.world} ranks holds its share of the routed experts)"
                          if self.experts_split else "") if self.lean else
                       "transformers forward over right-padded batches" + (
                           " (tensor parallel)" if self.tensor else f" ({type(self.model).__name__} has no packed forward)"))
            self.log(f"device ready in {self.cuda_init_s:.1f} s, model loaded in {self.model_load_s:.1f} s, warmed up in "
                     f"{self.warmup_s:.1f} s, for {shards} shard(s); {forward}")

    def share(self) -> dict:
        """One shard's share of the set-up: the device, the load and the warm-up divided over the
        shards that needed the model (so a 4-shard run's shares add up to one load)."""
        n = max(self.shards, 1)
        return {"cuda_init_s": self.cuda_init_s / n, "model_load_s": self.model_load_s / n, "warmup_s": self.warmup_s / n,
                "model_load_total_s": self.model_load_s, "shards_per_load": self.shards}


@dataclass
class _Plan:
    gens: pl.DataFrame | None  # the shard's generations, on rank 0 only
    todo: list
    resumed: int
    planned_s: float
    needed_bytes: int = 0  # of the files to write


def _plan(job: ExtractJob, target: _Target, locks: ExitStack, log) -> _Plan:
    """Rank 0: lock the shard, drop its manifest, and list the samples to (re)extract."""
    t0 = time.perf_counter()
    shard_dir, layout = Path(job.shard_dir), target.layout
    locks.enter_context(shard_lock(shard_dir))
    gens = pl.read_parquet(job.generations_path).select("row_id", "input_ids", "loss_mask")
    damaged = damaged_files(shard_dir)
    for name, _ in damaged:  # resized since the manifest was written: redone (a missing one is anyway)
        (shard_dir / name).unlink(missing_ok=True)
    (shard_dir / MANIFEST).unlink(missing_ok=True)  # the shard is incomplete until we rewrite it last
    todo, resumed = plan_shard(gens, shard_dir, layout, redo=job.redo)
    log(f"shard {shard_dir.name}: {len(gens)} samples, {len(todo)} to extract, {resumed} resumed from valid files "
        f"of layout {layout.name} ({layout.bytes_per_token():,} bytes per token)"
        + (f"; {len(damaged)} missing or resized since its manifest: {', '.join(n for n, _ in damaged[:5])}"
           if damaged else ""))
    return _Plan(gens, todo, resumed, time.perf_counter() - t0,
                 layout.predict_bytes(sum(len(s[1]) for s in todo), len(todo)))


def _extract(job: ExtractJob, plan: _Plan, target: _Target, log: Callable[[str], None]) -> ShardResult | None:
    """One planned shard on every rank; its metadata on rank 0."""
    cfg, dist, dtype, hidden, aux_ids = job.config, target.dist, target.dtype, target.hidden, target.aux_ids
    shard_dir, todo, resumed = Path(job.shard_dir), plan.todo, plan.resumed
    # Data parallel: interleave the length-sorted list so every rank gets long and short samples.
    # Tensor parallel: every rank runs every sample (the collectives must match); rank 0 writes.
    mine = todo if target.tensor else sorted(todo, key=lambda s: len(s[1]), reverse=True)[dist.rank :: dist.world]
    layout = target.layout
    meta = {
        **layout.metadata(),  # format_version, and the layout where it is not bf16/last_hidden
        "target_model": job.target_name,
        "aux_layer_ids": ",".join(map(str, aux_ids)),
        "dtype": cfg.dtype,
        "hidden_size": str(hidden),
    }
    stop, reporter, progress = threading.Event(), None, None
    if dist.main:
        gens = plan.gens
        progress = DiskProgress(shard_dir, dict(zip(gens["row_id"].to_list(), gens["input_ids"].list.len().to_list())))
        reporter = threading.Thread(target=_report_every, args=(progress, cfg.progress_every_s, stop, log), daemon=True)
        reporter.start()
    t3 = time.perf_counter()
    try:
        # Every rank gets here and to the gather below, failed or not, so the ranks stay in step
        # and a failure of this shard on any rank fails this shard only.
        failed = _attempt(
            extract_samples,
            target.model,
            mine,
            shard_dir,
            aux_layer_ids=aux_ids,
            dtype=dtype,
            batch_tokens=cfg.batch_tokens,
            writer_threads=cfg.writer_threads,
            metadata=meta,
            lean=target.lean,
            write=target.writes,
            layout=layout,
            teacher=target.teacher,
        ) if mine else None
        if dist.device.type == "cuda":
            torch.cuda.synchronize()
        extract_s = time.perf_counter() - t3
    finally:
        stop.set()
        if reporter:
            reporter.join()
    ranks = dist.gather({"tokens": sum(len(s[1]) for s in mine), "extract_s": extract_s,
                         "error": f"{type(failed).__name__}: {failed}" if failed is not None else None})
    if failed is not None:
        raise failed
    errors = [f"rank {i}: {r['error']}" for i, r in enumerate(ranks) if r["error"]]
    if errors:
        raise RuntimeError(f"shard {shard_dir.name} failed on " + "; ".join(errors))
    if not dist.main:
        return None
    log(progress.line())
    gens = plan.gens
    missing = [r for r in gens["row_id"] if not sample_file(shard_dir, r).exists()]
    if missing:
        raise RuntimeError(f"shard {shard_dir.name}: {len(missing)} sample files missing after extraction, e.g. {missing[:5]}")
    manifest_df = write_manifest(shard_dir, gens["row_id"].to_list())
    extract_s = max(r["extract_s"] for r in ranks)
    new_tokens = ranks[0]["tokens"] if target.tensor else sum(r["tokens"] for r in ranks)
    samples = len(manifest_df)
    tokens = int(manifest_df["tokens"].sum())
    metadata = {
        "path": str(shard_dir),
        "samples": samples,
        "tokens": tokens,
        "tokens_extracted": new_tokens,
        "samples_resumed": resumed,
        "bytes_on_disk": bytes_on_disk(shard_dir),
        "bytes_expected": tokens * layout.bytes_per_token(),
        "bytes_per_token": layout.bytes_per_token(),
        "storage": cfg.storage,
        "teacher": cfg.teacher,
        "aux_layer_ids": aux_ids,
        "dtype": cfg.dtype,
        "processes": dist.world,
        "parallel": ("expert" if target.experts_split else cfg.parallel) if dist.world > 1 else "none",
        "device": str(dist.device.type),
        "hidden_size": hidden,
        "forward": "packed" if target.lean else "padded_batches",
    }
    if cfg.teacher == "topk":
        metadata.update(topk=cfg.topk, topk_mass=topk_mass(shard_dir, gens["row_id"].to_list()))
    share = target.share() if new_tokens else {}
    set_up_s = sum(share.get(k, 0.0) for k in ("cuda_init_s", "model_load_s", "warmup_s"))
    metadata["job_s"] = plan.planned_s + time.perf_counter() - t3 + set_up_s  # this shard's time, with its share
    if new_tokens:  # rates only for work done: a shard resumed whole has none to plot
        metadata.update({
            "tokens_per_s": new_tokens / extract_s,
            "samples_per_s": (samples - resumed) / extract_s,
            **share,
            "extract_s": extract_s,
        })
    return ShardResult(metadata)


def _report_every(progress: DiskProgress, every: float, stop: threading.Event, log) -> None:
    while not stop.wait(every):
        log(progress.line())


def topk_mass(shard_dir: Path, row_ids: list[int], files: int = 64) -> float:
    """Mean share of the target's probability that the stored top-k keeps, over the tokens of up
    to `files` evenly spread sample files: how much of the teacher a top-k shard holds."""
    from safetensors import safe_open

    kept = []
    for r in row_ids[:: max(1, len(row_ids) // files)][:files]:
        with safe_open(str(sample_file(shard_dir, r)), framework="pt") as f:  # that tensor only, not the file
            kept.append(f.get_tensor("topk_logprobs").float().exp().sum(-1))
    return round(float(torch.cat(kept).mean()), 6) if kept else 0.0
