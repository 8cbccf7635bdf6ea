"""Pick the generation engine from the settings: native, transformers or vLLM.

Every engine writes the same generations Parquet (`GENERATION_SCHEMA`) from the same
templated prompt ids (`template_ids`) and the same EOS ids; this function loads the
chosen engine, times the load and returns what the `generations` asset reports.

`engine: auto` (the default) is the native engine (`native_generate.py`: continuous
batching, CUDA graph) on CUDA for the models it runs (Llama, Qwen2, Qwen3 dense), and
transformers `generate` everywhere else; the run log says which and why.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import polars as pl

from .generate import GenerationConfig, GenerationResult, generation_row, template_ids, write_generations


@dataclass
class EngineRun:
    result: GenerationResult
    engine: str
    model_load_s: float
    device: str
    extra_metadata: dict = field(default_factory=dict)  # engine-specific figures for the asset's metadata


def generate(
    gen: GenerationConfig,
    model_dir: Path,
    prompts: pl.DataFrame,
    out_path: Path,
    *,
    log: Callable[[str], None] = lambda msg: None,
) -> EngineRun:
    """Answer `prompts` with the engine `gen.engine` names; write the generations Parquet to `out_path`."""
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
            tensor_parallel_size=gen.tensor_parallel_size, dtype=gen.dtype, llm=llm, log=log,
        )
        return EngineRun(result, "vllm", load_s, f"cuda x{gen.tensor_parallel_size} (vLLM tensor parallel)")

    from .target import load_model

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
    if engine == "native":
        return _native(gen, model, tok, prompts, out_path, load_s, device, log)

    from .generate import generate_shard

    result = generate_shard(
        model, tok, prompts, out_path, batch_size=gen.batch_size, max_new_tokens=gen.max_new_tokens,
        do_sample=gen.do_sample, temperature=gen.temperature, top_p=gen.top_p, seed=gen.seed, log=log,
    )
    return EngineRun(result, "transformers", load_s, device)


def _native(gen: GenerationConfig, model, tok, prompts: pl.DataFrame, out_path: Path, load_s: float, device: str,
            log) -> EngineRun:
    from .native_generate import generate_native
    from .target import eos_token_ids

    encoded = {row["row_id"]: template_ids(tok, row["system"], row["prompt"]) for row in prompts.iter_rows(named=True)}
    r = generate_native(
        model, list(encoded.items()), eos_ids=eos_token_ids(model, tok), max_new_tokens=gen.max_new_tokens,
        do_sample=gen.do_sample, temperature=gen.temperature, top_p=gen.top_p, seed=gen.seed,
        max_slots=gen.max_slots, gpu_memory_fraction=gen.gpu_memory_fraction, refill_every=gen.refill_every, log=log,
    )
    rows = [generation_row(row_id, encoded[row_id], answer, finished) for row_id, answer, finished in r.rows]
    result = write_generations(rows, out_path, r.total_s)
    log(f"native engine: {r.answer_tokens:,} answer tokens in {r.total_s:.1f} s ({r.tokens_per_s:,.0f} tok/s; "
        f"set-up {r.extra['setup_s']:.1f} s, prefill {r.prefill_s:.1f} s, decode {r.decode_s:.1f} s), "
        f"mean slot occupancy {r.mean_occupancy:.2f} of {r.slots} slots")
    return EngineRun(result, "native", load_s, device, {
        "setup_s": round(r.extra["setup_s"], 3),
        "prefill_s": round(r.prefill_s, 3),
        "decode_s": round(r.decode_s, 3),
        "decode_steps": r.decode_steps,
        "mean_slot_occupancy": round(r.mean_occupancy, 4),
        "slots": r.slots,
        "kv_cache_bytes": r.kv_cache_bytes,
        "cuda_graph": r.cuda_graph,
        "attention": r.attention,
    })
