"""Pick the generation engine from the settings: native, transformers or vLLM.

Every engine writes the same generations Parquet (`GENERATION_SCHEMA`) from the same
templated prompt ids (`template_ids`) and the same EOS ids. `load_generator` loads the
chosen engine once and times the load; `generate_shards` answers a range of shards with it
(one load for a multi-partition run), reporting each shard's `EngineRun` (what the
`generations` asset reports) or its error as soon as the shard is done.

`engine: auto` (the default) is the native engine (`native_generate.py`: continuous
batching, CUDA graph) on CUDA for the models it runs (Llama, Qwen2, Qwen3 dense), and
transformers `generate` everywhere else; the run log says which and why.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import polars as pl

from .config import from_dict, require
from .generate import Answer, GenerationConfig, GenerationResult, converse, write_generations
from .shards import shard_range
from .stopping import STOP, Stopped


def shard_prompts(prompts_path: Path, shard: str, all_turns: bool) -> tuple[pl.DataFrame, str]:
    """The prompt rows of `shard`, and the sha256 of what shapes their answers (the later turns
    too when every turn is answered): equal hashes, equal answers for the same code and settings.
    A table without all of the shard's rows is a ValueError."""
    start, end = shard_range(shard)
    rows = pl.read_parquet(prompts_path).filter(pl.col("row_id").is_between(start, end, closed="left"))
    if len(rows) != end - start:
        raise ValueError(f"shard {shard} expects rows {start}..{end - 1} but prompts has {len(rows)} of them; "
                         "materialize `prompts` again")
    columns = ("row_id", "system", "prompt") + (("later_turns",) if all_turns else ())
    return rows, hashlib.sha256(json.dumps(rows.select(*columns).rows()).encode()).hexdigest()


def unchanged(previous: dict, rows_sha256: str, code_version: str, out_path: Path) -> bool:
    """Whether a shard's answers on disk are the ones it would get now: its last materialization's
    `previous` metadata has the same prompt rows hash and code version (the prompt table may have
    changed elsewhere, e.g. prompts appended), and its file is there."""
    return (previous.get("rows_sha256") == rows_sha256 and previous.get("code_version") == code_version
            and Path(out_path).is_file())


def shard_job(prompts_path: Path, shard: str, out_path: Path, target_model: str, model_cache_dir: str | None,
              config: GenerationConfig, max_prompt_tokens: int | None) -> "GenerateJob":
    """The job of one shard: its rows of the prompt table, answered by the target into `out_path`."""
    from .target import resolve_target

    start, end = shard_range(shard)
    return GenerateJob(prompts_path=str(prompts_path), row_start=start, row_end=end, out_path=str(out_path),
                       model_dir=str(resolve_target(target_model, model_cache_dir)), config=config,
                       max_prompt_tokens=max_prompt_tokens)


@dataclass
class EngineRun:
    result: GenerationResult
    engine: str
    model_load_s: float
    device: str
    extra_metadata: dict = field(default_factory=dict)  # engine-specific figures for the asset's metadata
    shards_per_load: int = 1  # the shards that shared the load (`generate_shards`)

    def metadata(self) -> dict:
        """The shard's figures as the `generations` asset gets them; the asset adds its own (reuse, hashes)."""
        result = self.result
        return {
            "samples": result.samples,  # prompt rows x (1 + samples_per_prompt), less any with no answer
            **result.counts,  # turns asked; turns over the prompt budget; conversations cut by it
            "tokens": result.tokens,
            "prompt_tokens": result.prompt_tokens,
            "answer_tokens": result.answer_tokens,
            "tokens_per_s": round(result.tokens_per_s, 2),
            "generate_s": round(result.generate_s, 3),
            "model_load_s": round(self.model_load_s / self.shards_per_load, 3),  # this shard's share of the load
            "model_load_total_s": round(self.model_load_s, 3),
            "shards_per_load": self.shards_per_load,
            "engine": self.engine,
            "device": self.device,
            **self.extra_metadata,
        }


@dataclass
class Generator:
    """The engine `gen.engine` names, loaded once (`load_generator`); `answer` runs it over one shard's
    prompts, so several shards share one load and one engine set-up (vLLM's)."""

    gen: GenerationConfig
    model_dir: Path
    engine: str
    load_s: float
    device: str
    target: LoadedTarget | None = None  # native or transformers
    llm: object = None  # vLLM
    tokenizer: object = None  # vLLM

    def answer(self, prompts: pl.DataFrame, out_path: Path, *, max_prompt_tokens: int | None = None,
               log: Callable[[str], None] = lambda msg: None) -> EngineRun:
        """Answer `prompts`; write the generations Parquet to `out_path`. `max_prompt_tokens` bounds the
        prompt of every later turn (`generate.converse`). The run's `model_load_s` is the whole load."""
        gen = self.gen
        loop = dict(turns=gen.turns, samples_per_prompt=gen.samples_per_prompt, max_prompt_tokens=max_prompt_tokens)
        if self.engine == "vllm":
            from .vllm_engine import generate_shard_vllm

            result = generate_shard_vllm(
                self.model_dir, self.tokenizer, prompts, out_path, max_new_tokens=gen.max_new_tokens,
                do_sample=gen.do_sample, temperature=gen.temperature, top_p=gen.top_p, seed=gen.seed,
                tensor_parallel_size=gen.tensor_parallel_size, dtype=gen.dtype, llm=self.llm, log=log, **loop,
            )
            return EngineRun(result, "vllm", self.load_s, self.device)
        if self.engine == "native":
            return _native(gen, self.target, prompts, out_path, log, loop)
        from .generate import generate_shard

        target = self.target
        result = generate_shard(
            target.model, target.tokenizer, prompts, out_path, batch_size=gen.batch_size,
            max_new_tokens=gen.max_new_tokens, do_sample=gen.do_sample, temperature=gen.temperature, top_p=gen.top_p,
            seed=gen.seed, log=log, **loop,
        )
        return EngineRun(result, "transformers", target.load_s, target.device)


def load_generator(gen: GenerationConfig, model_dir: Path, log: Callable[[str], None] = lambda msg: None) -> Generator:
    """Load the engine `gen.engine` names (auto: `load_engine`'s choice), timed."""
    if gen.engine == "vllm":
        from .target import load_tokenizer
        from .vllm_engine import load_vllm

        t0 = time.perf_counter()
        llm = load_vllm(model_dir, tensor_parallel_size=gen.tensor_parallel_size, dtype=gen.dtype, seed=gen.seed)
        tok = load_tokenizer(model_dir)
        return Generator(gen, model_dir, "vllm", time.perf_counter() - t0,
                         f"cuda x{gen.tensor_parallel_size} (vLLM tensor parallel)", llm=llm, tokenizer=tok)
    target = load_engine(gen, model_dir, log)
    return Generator(gen, model_dir, target.engine, target.load_s, target.device, target=target)


def generate(
    gen: GenerationConfig,
    model_dir: Path,
    prompts: pl.DataFrame,
    out_path: Path,
    *,
    max_prompt_tokens: int | None = None,
    log: Callable[[str], None] = lambda msg: None,
) -> EngineRun:
    """Answer `prompts` with the engine `gen.engine` names; write the generations Parquet to `out_path`.
    `max_prompt_tokens` bounds the prompt of every later turn (`generate.converse`)."""
    return load_generator(gen, Path(model_dir), log).answer(prompts, out_path, max_prompt_tokens=max_prompt_tokens,
                                                            log=log)


@dataclass(frozen=True)
class GenerateJob:
    """One shard's generation: the prompt rows `row_start <= row_id < row_end` of the prompts
    Parquet, answered into `out_path` (whose stem is the shard's name)."""

    prompts_path: str
    row_start: int
    row_end: int
    out_path: str
    model_dir: str
    config: GenerationConfig = field(default_factory=GenerationConfig)
    max_prompt_tokens: int | None = None

    @property
    def shard(self) -> str:
        return Path(self.out_path).stem


@dataclass(frozen=True)
class GenerateShards:
    """Several shards answered by one engine load (a multi-partition run), as the launcher sends
    them to its process or pod: each shard keeps its own file, metadata and failure; they share
    the target, the generation config and the prompt budget."""

    jobs: list[GenerateJob]

    def __post_init__(self):
        require(len(self.jobs) > 0, "GenerateShards needs at least one shard")
        same = lambda j: (j.model_dir, j.config, j.max_prompt_tokens)  # noqa: E731
        require(all(same(j) == same(self.jobs[0]) for j in self.jobs),
                "the shards of one generation must share the target model, the generation config and max_prompt_tokens")

    @classmethod
    def from_json(cls, text: str) -> "GenerateShards":
        """From `{"jobs": [...]}`, or one `GenerateJob`'s JSON (a single shard)."""
        data = json.loads(text)
        return cls([from_dict(GenerateJob, j) for j in data["jobs"]] if "jobs" in data else [from_dict(GenerateJob, data)])


def job_rows(job: GenerateJob) -> pl.DataFrame:
    return pl.read_parquet(job.prompts_path).filter(pl.col("row_id").is_between(job.row_start, job.row_end, closed="left"))


def generate_shards(group: GenerateShards, log: Callable[[str], None],
                    report: Callable[[GenerateJob, EngineRun | BaseException], None]) -> None:
    """Answer every shard of `group` with one engine load. `report(job, result)` is called once per
    shard, as it finishes, with its `EngineRun` (its metadata holds its share of the load) or the
    exception that failed it; a failed shard does not stop the others, a stop (SIGTERM) stops
    before the next shard. What fails them all (the target cannot be loaded) raises."""
    first = group.jobs[0]
    generator = load_generator(first.config, Path(first.model_dir), log)
    n = len(group.jobs)
    log(f"generation engine {generator.engine} on {generator.device} loaded in {generator.load_s:.1f} s, "
        f"for {n} shard(s)")
    for job in group.jobs:
        if STOP.is_set():
            report(job, Stopped(f"stopped before shard {job.shard} began"))
            continue
        try:
            run = generator.answer(job_rows(job), Path(job.out_path), max_prompt_tokens=job.max_prompt_tokens, log=log)
        except Exception as e:  # noqa: BLE001 (reported for the shard, with its type and message)
            report(job, e)
            continue
        run.shards_per_load = n
        report(job, run)


def run_generation(job: GenerateJob, log: Callable[[str], None] = lambda msg: None) -> EngineRun:
    """One shard (`generate_shards` of one); raises its error."""
    results: list = []
    generate_shards(GenerateShards([job]), log, lambda job, result: results.append(result))
    if isinstance(results[0], BaseException):
        raise results[0]
    return results[0]


@dataclass
class LoadedTarget:
    """The target loaded for the native or the transformers engine (`load_engine`)."""

    model: object
    tokenizer: object
    eos_ids: list[int]
    engine: str  # "native" or "transformers"
    load_s: float
    device: str


def load_engine(gen: GenerationConfig, model_dir: Path, log: Callable[[str], None] = lambda msg: None) -> LoadedTarget:
    """Load the target and pick the engine for `gen.engine` (auto: native on CUDA for the models it
    runs, else transformers; the log says why). vLLM is not loaded here (`generate` does)."""
    from .target import eos_token_ids, load_model, load_tokenizer

    t0 = time.perf_counter()
    model = load_model(model_dir, gen.dtype, gen.device)
    tok = load_tokenizer(model_dir)
    load_s = time.perf_counter() - t0
    device = str(next(model.parameters()).device)
    engine = gen.engine
    if engine in ("auto", "native"):
        from .native_generate import native_supported

        ok, why = native_supported(model)
        if engine == "auto" and device.startswith("cpu"):
            ok, why = False, "on the CPU the transformers engine is the reference"
        if ok:
            engine = "native"
        else:
            log(f"generation engine: transformers ({why})")
            engine = "transformers"
    elif engine == "vllm":
        raise ValueError("load_engine loads the native or transformers engine; vLLM is loaded by generate()")
    return LoadedTarget(model, tok, eos_token_ids(model, tok), engine, load_s, device)


def answer_function(target: LoadedTarget, gen: GenerationConfig, eos_ids: list[int] | None = None,
                    calls: list | None = None, log: Callable[[str], None] = lambda msg: None) -> Answer:
    """The loaded engine as an `Answer` (`generate.converse`'s engine interface) with `gen`'s
    sampling settings, stopping at `eos_ids` (default: the target's). `calls` collects the native
    engine's per-call results."""
    eos_ids = list(eos_ids or target.eos_ids)
    if target.engine == "transformers":
        from .generate import transformers_answer

        return transformers_answer(target.model, target.tokenizer, eos_ids, batch_size=gen.batch_size,
                                   max_new_tokens=gen.max_new_tokens, temperature=gen.temperature, top_p=gen.top_p,
                                   seed=gen.seed)
    from .native_generate import generate_native

    def answer(batch, sampled):
        r = generate_native(
            target.model, batch, eos_ids=eos_ids, max_new_tokens=gen.max_new_tokens, do_sample=sampled,
            temperature=gen.temperature, top_p=gen.top_p, seed=gen.seed, max_slots=gen.max_slots,
            gpu_memory_fraction=gen.gpu_memory_fraction, refill_every=gen.refill_every, log=log,
        )
        if calls is not None:
            calls.append(r)
        return [(a, f) for _, a, f in r.rows]

    return answer


def _native(gen: GenerationConfig, target: LoadedTarget, prompts: pl.DataFrame, out_path: Path, log,
            loop: dict) -> EngineRun:
    calls = []  # one engine call per turn and sampling mode
    answer = answer_function(target, gen, calls=calls, log=log)
    tok, eos_ids, load_s, device = target.tokenizer, target.eos_ids, target.load_s, target.device
    t0 = time.perf_counter()
    rows, counts = converse(answer, tok, prompts, eos_ids, do_sample=gen.do_sample, log=log, **loop)
    total_s = sum(r.total_s for r in calls)
    between_s = time.perf_counter() - t0 - total_s  # templating and tokenizing the turns, outside the engine
    parts = {k: sum(r.extra.get(k, 0.0) for r in calls) for k in ("plan_s", "alloc_s", "capture_s")}
    result = write_generations(rows, out_path, total_s, counts)
    steps = sum(r.decode_steps for r in calls)
    occupancy = sum(r.mean_occupancy * r.decode_steps for r in calls) / steps if steps else 0.0
    answer_tokens = sum(r.answer_tokens for r in calls)
    log(f"native engine: {answer_tokens:,} answer tokens in {total_s:.1f} s "
        f"({answer_tokens / total_s if total_s else 0:,.0f} tok/s; {len(calls)} calls, set-up "
        f"{sum(r.extra['setup_s'] for r in calls):.1f} s (planning {parts['plan_s']:.1f}, allocation "
        f"{parts['alloc_s']:.1f}, capture {parts['capture_s']:.1f}), prefill {sum(r.prefill_s for r in calls):.1f} s, "
        f"decode {sum(r.decode_s for r in calls):.1f} s; {between_s:.1f} s between calls), "
        f"mean slot occupancy {occupancy:.2f}")
    last = calls[-1] if calls else None
    return EngineRun(result, "native", load_s, device, {
        "setup_s": round(sum(r.extra["setup_s"] for r in calls), 3),
        **{f"setup_{k}": round(v, 3) for k, v in parts.items()},
        "between_calls_s": round(between_s, 3),
        "prefill_s": round(sum(r.prefill_s for r in calls), 3),
        "decode_s": round(sum(r.decode_s for r in calls), 3),
        "decode_steps": steps,
        "mean_slot_occupancy": round(occupancy, 4),
        "slots": max((r.slots for r in calls), default=0),
        "kv_cache_bytes": max((r.kv_cache_bytes for r in calls), default=0),
        "cuda_graph": bool(last and last.cuda_graph),
        "attention": last.attention if last else "",
        "engine_calls": len(calls),
    })
