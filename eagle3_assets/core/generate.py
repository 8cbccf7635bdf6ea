"""The target answers its prompts: batched transformers generation.

Each sample is stored as the token ids of prompt + answer (through the chat
template) and a loss mask that is 1 on the answer tokens, the tokens the drafter
learns to predict. Greedy by default; sampling is configurable.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import torch

from .files import atomic_write_parquet
from .prompts import chat_messages

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
    device = next(model.parameters()).device
    eos_ids = _eos_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    encoded = [
        (row["row_id"], template_ids(tokenizer, row["system"], row["prompt"])) for row in prompts.iter_rows(named=True)
    ]
    # Similar lengths in a batch waste less compute on padding.
    order = sorted(encoded, key=lambda r: len(r[1]))
    rows, answer_total, prompt_total = [], 0, 0
    torch.manual_seed(seed + (int(prompts["row_id"].min()) if len(prompts) else 0))
    start = time.perf_counter()
    for b in range(0, len(order), batch_size):
        batch = order[b : b + batch_size]
        width = max(len(ids) for _, ids in batch)
        # Left padding: every prompt ends where generation starts.
        input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for _, ids in batch], device=device)
        attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in batch], device=device)
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
        for (row_id, ids), gen in zip(batch, out[:, width:].tolist()):
            answer, finished = _cut_at_eos(gen, eos_ids)
            rows.append(
                {
                    "row_id": row_id,
                    "input_ids": ids + answer,
                    "loss_mask": [0] * len(ids) + [1] * len(answer),
                    "prompt_tokens": len(ids),
                    "answer_tokens": len(answer),
                    "finished": finished,
                }
            )
            answer_total += len(answer)
            prompt_total += len(ids)
        log(f"generated {len(rows)}/{len(order)} samples, {answer_total} answer tokens")
    elapsed = time.perf_counter() - start
    df = pl.DataFrame(rows, schema=GENERATION_SCHEMA).sort("row_id")
    atomic_write_parquet(df, out_path)
    return GenerationResult(len(rows), prompt_total, answer_total, elapsed)


def _eos_ids(model, tokenizer) -> list[int]:
    eos = model.generation_config.eos_token_id
    ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def _cut_at_eos(gen: list[int], eos_ids: list[int]) -> tuple[list[int], bool]:
    for i, t in enumerate(gen):
        if t in eos_ids:
            return gen[: i + 1], True  # the EOS is part of the answer: the drafter learns to stop
    return gen, False


def read_generations(path: Path) -> pl.DataFrame:
    return pl.read_parquet(path)
