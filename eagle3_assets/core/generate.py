"""The target answers its prompts: batched transformers generation.

Each sample is stored as the token ids of prompt + answer (through the chat
template) and a loss mask that is 1 on the answer tokens, the tokens the drafter
learns to predict. Greedy by default; sampling is configurable.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal

import polars as pl
import torch

from .config import STRICT, Fraction, PositiveFloat, PositiveInt
from .files import atomic_write_parquet
from .prompts import chat_messages
from .target import eos_token_ids

@dataclass(frozen=True)
class GenerationConfig:
    """The `generation:` section of the settings."""

    __pydantic_config__ = STRICT
    # auto: the native engine on CUDA for the models it runs, else transformers (the log says why).
    engine: Literal["auto", "native", "transformers", "vllm"] = "auto"
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    device: str = "auto"
    batch_size: PositiveInt = 32  # prompts per `generate` call (transformers)
    # native engine: sequences decoded at once (None: 2,048 on CUDA, fewer if the KV cache would
    # not fit), the share of the card's memory the cache may take, and how often freed slots refill
    max_slots: PositiveInt | None = None
    gpu_memory_fraction: Fraction = 0.9
    refill_every: PositiveInt = 16
    max_new_tokens: PositiveInt = 512
    do_sample: bool = False
    temperature: PositiveFloat = 0.7
    top_p: Fraction = 1.0
    seed: int = 0
    tensor_parallel_size: PositiveInt = 1  # vLLM only


GENERATION_SCHEMA = {
    "row_id": pl.Int64,
    "input_ids": pl.List(pl.Int32),
    "loss_mask": pl.List(pl.UInt8),
    "prompt_tokens": pl.Int32,
    "answer_tokens": pl.Int32,
    "finished": pl.Boolean,  # the answer ended with EOS rather than at max_new_tokens
}


@dataclass
class GenerationResult:
    samples: int
    prompt_tokens: int
    answer_tokens: int
    generate_s: float

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.answer_tokens

    @property
    def tokens_per_s(self) -> float:
        """Answer tokens generated per second of generation."""
        return self.answer_tokens / self.generate_s if self.generate_s > 0 else 0.0


def template_ids(tokenizer, system: str | None, prompt: str) -> list[int]:
    out = tokenizer.apply_chat_template(chat_messages(system, prompt), add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def generate_shard(
    model,
    tokenizer,
    prompts: pl.DataFrame,
    out_path: Path,
    *,
    batch_size: int,
    max_new_tokens: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    log=lambda msg: None,
) -> GenerationResult:
    """Answer `prompts` (row_id, system, prompt) and write the generations Parquet."""
    eos_ids = eos_token_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    encoded = [
        (row["row_id"], template_ids(tokenizer, row["system"], row["prompt"])) for row in prompts.iter_rows(named=True)
    ]
    # Similar lengths in a batch waste less compute on padding.
    order = sorted(encoded, key=lambda r: len(r[1]))
    rows, answer_total = [], 0
    torch.manual_seed(seed + (int(prompts["row_id"].min()) if len(prompts) else 0))
    start = time.perf_counter()
    for b in range(0, len(order), batch_size):
        batch = order[b : b + batch_size]
        answers = generate_batch(model, [ids for _, ids in batch], pad_id, eos_ids, max_new_tokens,
                                 do_sample=do_sample, temperature=temperature, top_p=top_p)
        for (row_id, ids), (answer, finished) in zip(batch, answers):
            rows.append(generation_row(row_id, ids, answer, finished))
            answer_total += len(answer)
        log(f"generated {len(rows)}/{len(order)} samples, {answer_total} answer tokens")
    return write_generations(rows, out_path, time.perf_counter() - start)


def generate_batch(
    model, prompts: list[list[int]], pad_id: int, eos_ids: list[int], max_new_tokens: int, *,
    do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0,
) -> list[tuple[list[int], bool]]:
    """One transformers `generate` call over left-padded prompts: (answer, ended with EOS) each."""
    device = next(model.parameters()).device
    width = max(len(ids) for ids in prompts)
    # Left padding: every prompt ends where generation starts.
    input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in prompts], device=device)
    attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts], device=device)
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            temperature=temperature if do_sample else None,
            top_p=top_p if do_sample else None,
            top_k=None,
            pad_token_id=pad_id,
            eos_token_id=eos_ids,
        )
    return [cut_at_eos(gen, eos_ids) for gen in out[:, width:].tolist()]


def cut_at_eos(generated: list[int], eos_ids: Iterable[int]) -> tuple[list[int], bool]:
    """The answer up to and including the first EOS, and whether there was one."""
    eos = set(eos_ids)
    for i, t in enumerate(generated):
        if t in eos:
            return list(generated[: i + 1]), True
    return list(generated), False


def generation_row(row_id: int, prompt_ids: list[int], answer: list[int], finished: bool) -> dict:
    """One row of the generations Parquet (GENERATION_SCHEMA)."""
    return {
        "row_id": int(row_id),
        "input_ids": list(prompt_ids) + list(answer),
        "loss_mask": [0] * len(prompt_ids) + [1] * len(answer),
        "prompt_tokens": len(prompt_ids),
        "answer_tokens": len(answer),
        "finished": bool(finished),
    }


def write_generations(rows: list[dict], out_path: Path, generate_s: float) -> GenerationResult:
    """Write the rows (sorted by row_id) atomically; return the shard's totals."""
    df = pl.DataFrame(rows, schema=GENERATION_SCHEMA).sort("row_id")
    atomic_write_parquet(df, Path(out_path))
    return GenerationResult(
        samples=len(rows),
        prompt_tokens=int(df["prompt_tokens"].sum()) if len(rows) else 0,
        answer_tokens=int(df["answer_tokens"].sum()) if len(rows) else 0,
        generate_s=generate_s,
    )

