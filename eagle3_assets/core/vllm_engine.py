"""The target answers its prompts through vLLM's offline `LLM` engine.

Same contract as the transformers engine (`core/generate.py`): our code applies the
chat template (`template_ids`) and hands vLLM the prompt token ids, so both engines
see identical prompts; each row stores prompt + answer token ids with a loss mask
on the answer, in the same Parquet schema (`GENERATION_SCHEMA`).

vLLM is imported inside the functions: it pulls a CUDA build of torch and is an
optional extra (`pip install eagle3-assets[vllm]`).

The mapping onto vLLM's API (`vllm.LLM`, `vllm.SamplingParams`, `LLM.generate`,
`RequestOutput.outputs[0].token_ids / finish_reason`):

- greedy is `temperature=0` (vLLM: "Zero means greedy sampling"); sampling passes
  `temperature` and `top_p`;
- every request gets its own `seed = settings seed + sampling id` (the row id at the first
  turn; `generate.sampling_id` for later turns), so a row's answer does not depend on which
  shard or batch it landed in;
- later turns and extra samples come from the shared turn loop (`generate.converse`), which
  calls `LLM.generate` once per turn and sampling mode;
- `stop_token_ids` are the target's EOS ids (generation config + tokenizer), as the
  transformers engine stops on them; vLLM keeps a stop token in `token_ids`
  (`check_stop` appends before it stops), and the row keeps it too: the drafter
  learns to stop;
- `finish_reason` is "stop" (EOS / stop token) or "length" (`max_tokens` or the
  model's context length). vLLM checks the length cap before the stop tokens, so an
  answer whose last allowed token is EOS reports "length"; `finished` is therefore
  read from the tokens, exactly as the transformers engine does.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import polars as pl

from .generate import GenerationResult, converse, cut_at_eos, write_generations
from .target import eos_token_ids


# --- vLLM ---------------------------------------------------------------------------------------


def load_vllm(model_dir: Path, *, tensor_parallel_size: int = 1, dtype: str = "auto", seed: int = 0):
    """vLLM's offline engine over the target folder (weights and tokenizer from the same place)."""
    try:
        from vllm import LLM
    except ImportError as e:
        raise ImportError(
            "generation.engine is 'vllm' but vLLM is not installed: pip install 'eagle3-assets[vllm]' "
            "(it needs a CUDA build of torch), or set generation.engine: transformers"
        ) from e
    return LLM(
        model=str(model_dir),
        tokenizer=str(model_dir),
        tensor_parallel_size=tensor_parallel_size,
        dtype=dtype,
        seed=seed,
    )


def sampling_params(
    *, max_new_tokens: int, do_sample: bool, temperature: float, top_p: float, seed: int, eos_ids: list[int]
):
    from vllm import SamplingParams

    return SamplingParams(
        n=1,
        max_tokens=max_new_tokens,
        temperature=temperature if do_sample else 0.0,
        top_p=top_p if do_sample else 1.0,
        seed=seed,
        stop_token_ids=list(eos_ids),
        detokenize=False,  # we keep token ids only
    )


def generate_shard_vllm(
    model_dir: Path,
    tokenizer,
    prompts: pl.DataFrame,
    out_path: Path,
    *,
    max_new_tokens: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    tensor_parallel_size: int = 1,
    dtype: str = "auto",
    llm=None,
    turns: str = "first",
    samples_per_prompt: int = 0,
    max_prompt_tokens: int | None = None,
    log: Callable[[str], None] = lambda msg: None,
) -> GenerationResult:
    """Answer `prompts` (row_id, system, prompt) with vLLM and write the generations Parquet.

    `llm` is an already loaded `vllm.LLM` (see `load_vllm`); without it one is loaded here.
    """
    if llm is None:
        t0 = time.perf_counter()
        llm = load_vllm(model_dir, tensor_parallel_size=tensor_parallel_size, dtype=dtype, seed=seed)
        log(f"vLLM loaded {model_dir} in {time.perf_counter() - t0:.1f} s (tensor parallel {tensor_parallel_size})")
    eos_ids = eos_token_ids(Path(model_dir), tokenizer)
    elapsed = 0.0

    def answer(batch: list[tuple[int, list[int]]], sampled: bool) -> list[tuple[list[int], bool]]:
        nonlocal elapsed
        requests = [{"prompt_token_ids": ids} for _, ids in batch]  # vllm.inputs.TokensPrompt is this TypedDict
        params = [
            sampling_params(max_new_tokens=max_new_tokens, do_sample=sampled, temperature=temperature, top_p=top_p,
                            seed=seed + key, eos_ids=eos_ids)
            for key, _ in batch
        ]
        start = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=False) if requests else []
        elapsed += time.perf_counter() - start
        if len(outputs) != len(batch):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(batch)} prompts")
        out = []
        for (key, ids), o in zip(batch, outputs):
            if list(o.prompt_token_ids) != ids:  # LLM.generate returns outputs in input order
                raise RuntimeError(f"vLLM output for request {key} answers a different prompt")
            completion = o.outputs[0]
            ans, finished = cut_at_eos(list(completion.token_ids), eos_ids)
            stop = getattr(completion, "stop_reason", None)
            if not finished and completion.finish_reason == "stop" and isinstance(stop, int) and stop in eos_ids:
                # A stop token that the engine left out of token_ids: keep it, the drafter learns to stop.
                ans, finished = ans + [stop], True
            out.append((ans, finished))
        return out

    rows, counts = converse(answer, tokenizer, prompts, eos_ids, turns=turns, samples_per_prompt=samples_per_prompt,
                            do_sample=do_sample, max_prompt_tokens=max_prompt_tokens, log=log)
    result = write_generations(rows, out_path, elapsed, counts)
    log(f"generated {result.samples} samples, {result.answer_tokens} answer tokens with vLLM in {elapsed:.1f} s")
    return result
