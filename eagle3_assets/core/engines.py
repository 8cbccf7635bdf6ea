"""Pick the generation engine from the settings: transformers (default) or vLLM.

Both write the same generations Parquet (`GENERATION_SCHEMA`) from the same
templated prompt ids; this function loads the chosen engine, times the load and
returns what the `generations` asset reports.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import polars as pl

from .generate import GenerationConfig, GenerationResult


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

    if gen.engine == "transformers":
        from .generate import generate_shard
        from .target import load_model

        t0 = time.perf_counter()
        model = load_model(model_dir, gen.dtype, gen.device)
        tok = load_tokenizer(model_dir)
        load_s = time.perf_counter() - t0
        result = generate_shard(
            model,
            tok,
            prompts,
            out_path,
            batch_size=gen.batch_size,
            max_new_tokens=gen.max_new_tokens,
            do_sample=gen.do_sample,
            temperature=gen.temperature,
            top_p=gen.top_p,
            seed=gen.seed,
            log=log,
        )
        return EngineRun(result, "transformers", load_s, str(next(model.parameters()).device))
    if gen.engine == "vllm":
        from .vllm_engine import generate_shard_vllm, load_vllm

        t0 = time.perf_counter()
        llm = load_vllm(model_dir, tensor_parallel_size=gen.tensor_parallel_size, dtype=gen.dtype, seed=gen.seed)
        tok = load_tokenizer(model_dir)
        load_s = time.perf_counter() - t0
        result = generate_shard_vllm(
            model_dir,
            tok,
            prompts,
            out_path,
            max_new_tokens=gen.max_new_tokens,
            do_sample=gen.do_sample,
            temperature=gen.temperature,
            top_p=gen.top_p,
            seed=gen.seed,
            tensor_parallel_size=gen.tensor_parallel_size,
            dtype=gen.dtype,
            llm=llm,
            log=log,
        )
        return EngineRun(result, "vllm", load_s, f"cuda x{gen.tensor_parallel_size} (vLLM tensor parallel)")
    raise ValueError(f"unknown generation engine {gen.engine!r}; use 'transformers' or 'vllm'")
