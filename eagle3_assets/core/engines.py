"""Pick the generation engine from the settings: native, transformers or vLLM.

Every engine writes the same generations Parquet (`GENERATION_SCHEMA`) from the same
templated prompt ids (`template_ids`) and the same EOS ids; this function loads the
chosen engine, times the load and returns what the `generations` asset reports.

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

from .generate import Answer, GenerationConfig, GenerationResult, converse, write_generations
from .shards import shard_range


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


@dataclass
class EngineRun:
    result: GenerationResult
    engine: str
    model_load_s: float
    device: str
    extra_metadata: dict = field(default_factory=dict)  # engine-specific figures for the asset's metadata

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
            "model_load_s": round(self.model_load_s, 3),
            "engine": self.engine,
            "device": self.device,
            **self.extra_metadata,
        }


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
    loop = dict(turns=gen.turns, samples_per_prompt=gen.samples_per_prompt, max_prompt_tokens=max_prompt_tokens)
    from .target import load_tokenizer

    if gen.engine == "vllm":
        from .vllm_engine import generate_shard_vllm, load_vllm

        t0 = time.perf_counter()
        llm = load_vllm(model_dir, tensor_parallel_size=gen.tensor_parallel_size, dtype=gen.dtype, seed=gen.seed)
        tok = load_tokenizer(model_dir)
        load_s = time.perf_counter() - t0
        result = generate_shard_vllm(
            model_dir, tok, prompts, out_path, max_new_tokens=gen.max_new_tokens, do_sample=gen.do_sample,
            temperature=gen.temperature, top_p=gen.top_p, seed=gen.seed,
            tensor_parallel_size=gen.tensor_parallel_size, dtype=gen.dtype, llm=llm, log=log, **loop,
        )
        return EngineRun(result, "vllm", load_s, f"cuda x{gen.tensor_parallel_size} (vLLM tensor parallel)")

    target = load_engine(gen, model_dir, log)
    if target.engine == "native":
        return _native(gen, target, prompts, out_path, log, loop)

    from .generate import generate_shard

    result = generate_shard(
        target.model, target.tokenizer, prompts, out_path, batch_size=gen.batch_size, max_new_tokens=gen.max_new_tokens,
        do_sample=gen.do_sample, temperature=gen.temperature, top_p=gen.top_p, seed=gen.seed, log=log, **loop,
    )
    return EngineRun(result, "transformers", target.load_s, target.device)


@dataclass(frozen=True)
class GenerateJob:
    """One shard's generation, as the launcher sends it to its process or pod: the prompt rows
    `row_start <= row_id < row_end` of the prompts Parquet, answered into `out_path`."""

    prompts_path: str
    row_start: int
    row_end: int
    out_path: str
    model_dir: str
    config: GenerationConfig = field(default_factory=GenerationConfig)
    max_prompt_tokens: int | None = None


def run_generation(job: GenerateJob, log: Callable[[str], None] = lambda msg: None) -> EngineRun:
    """`generate` over the job's rows (the entry module `entrypoints.generate_answers` runs it)."""
    rows = pl.read_parquet(job.prompts_path).filter(pl.col("row_id").is_between(job.row_start, job.row_end, closed="left"))
    return generate(job.config, Path(job.model_dir), rows, Path(job.out_path), max_prompt_tokens=job.max_prompt_tokens,
                    log=log)


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
    rows, counts = converse(answer, tok, prompts, eos_ids, do_sample=gen.do_sample, log=log, **loop)
    total_s = sum(r.total_s for r in calls)
    result = write_generations(rows, out_path, total_s, counts)
    steps = sum(r.decode_steps for r in calls)
    occupancy = sum(r.mean_occupancy * r.decode_steps for r in calls) / steps if steps else 0.0
    answer_tokens = sum(r.answer_tokens for r in calls)
    log(f"native engine: {answer_tokens:,} answer tokens in {total_s:.1f} s "
        f"({answer_tokens / total_s if total_s else 0:,.0f} tok/s; {len(calls)} calls, set-up "
        f"{sum(r.extra['setup_s'] for r in calls):.1f} s, prefill {sum(r.prefill_s for r in calls):.1f} s, decode "
        f"{sum(r.decode_s for r in calls):.1f} s), mean slot occupancy {occupancy:.2f}")
    last = calls[-1] if calls else None
    return EngineRun(result, "native", load_s, device, {
        "setup_s": round(sum(r.extra["setup_s"] for r in calls), 3),
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
