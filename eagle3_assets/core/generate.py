"""The target answers its prompts: the turn loop every engine runs, and the transformers engine.

Each sample is stored as the token ids of a conversation (through the chat template) and a
loss mask that is 1 on the answers the target gave, the tokens the drafter learns to predict.

One turn loop (`converse`) drives every engine, which only answers a batch of templated prompts
(`Answer`): turn 1 for every sample, then turn 2 for the samples whose conversation has one,
and so on (`generation.turns: all`; `first`, the default, stops after turn 1). The prompt of
turn k is the sample's own tokens so far (the earlier prompts and the target's own answers,
token for token) followed by the chat template's text between that answer and the next
generation prompt (which closes an answer cut at `max_new_tokens`, as a chat would); so a
conversation is one sample and no history is stored twice. A turn whose prompt would exceed
`max_prompt_tokens` is not asked: the conversation ends at the last answer that fit (counted).

`generation.samples_per_prompt` adds that many sampled answers (temperature, top-p) beside the
main one (greedy unless `do_sample`). Sample s of prompt row r is row `r + s * SAMPLE_ROW_STRIDE`
of the generations (s = 0 keeps the prompt's row id), so a shard `rows_a-b` holds prompt rows
a..b-1 and their samples, and every row id is unique and stable. Sampling noise is a function of
(seed, row id, turn, position, vocab id) in every engine but vLLM (which seeds each request with
seed + that id): a row's answer does not depend on its batch or shard.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Literal

import polars as pl
import torch

from .config import STRICT, Fraction, NonNegativeInt, PositiveFloat, PositiveInt
from .files import atomic_write_parquet
from .prompts import chat_messages
from .target import eos_token_ids

SAMPLE_ROW_STRIDE = 10**8  # row id of sample s of prompt row r: r + s * SAMPLE_ROW_STRIDE
_TURN_KEY_STRIDE = 1 << 40  # sampling id of turn t of row r: r + t * _TURN_KEY_STRIDE

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
    # first: the first human turn of each conversation; all: every human turn, each answered after
    # the target's own earlier answers (one sample per conversation).
    turns: Literal["first", "all"] = "first"
    # sampled answers (temperature, top_p) per prompt beside the main one (greedy unless do_sample)
    samples_per_prompt: NonNegativeInt = 0


GENERATION_SCHEMA = {
    "row_id": pl.Int64,
    "input_ids": pl.List(pl.Int32),
    "loss_mask": pl.List(pl.UInt8),
    "prompt_tokens": pl.Int32,
    "answer_tokens": pl.Int32,
    "finished": pl.Boolean,  # the last answer ended with EOS rather than at max_new_tokens
    "turns": pl.Int32,  # answers the target gave in this sample (its human turns answered)
}


@dataclass
class GenerationResult:
    samples: int
    prompt_tokens: int
    answer_tokens: int
    generate_s: float
    counts: dict = field(default_factory=dict)  # turn loop figures (`converse`), for the metadata

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


# An engine, as the turn loop sees it: answer these (sampling id, templated prompt ids), greedily
# (False) or by sampling (True); return (answer ids up to and including EOS, ended with EOS) each.
Answer = Callable[[list[tuple[int, list[int]]], bool], list[tuple[list[int], bool]]]


def sample_row_id(row_id: int, sample: int) -> int:
    return int(row_id) + sample * SAMPLE_ROW_STRIDE


def sampling_id(row_id: int, turn: int) -> int:
    """The id an engine keys a row's sampling noise with at one turn (turn 0: the row id)."""
    return int(row_id) + turn * _TURN_KEY_STRIDE


_SENTINEL = "\x00eagle3-answer-{}\x00"  # stands for an answer while the template renders


def turn_glue_ids(tokenizer, system: str | None, humans: list[str], eos_text: str | None) -> list[int]:
    """The tokens the chat template puts between the target's answer to humans[-2] and the
    generation prompt after humans[-1]: end of that answer (unless it ended with EOS, whose
    text is `eos_text`), the new user turn, the assistant header. Rendered with stand-ins for
    the answers, so the target's own answer tokens are kept as they were generated."""
    msgs = [{"role": "system", "content": system}] if system else []
    for i, text in enumerate(humans):
        msgs.append({"role": "user", "content": text})
        if i < len(humans) - 1:
            msgs.append({"role": "assistant", "content": _SENTINEL.format(i)})
    rendered = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    marker = _SENTINEL.format(len(humans) - 2)
    if marker not in rendered:
        raise ValueError("the chat template drops earlier assistant turns; use generation.turns: first")
    glue = rendered.split(marker, 1)[1]
    if eos_text and glue.startswith(eos_text):
        glue = glue[len(eos_text):]  # the answer's own EOS already closes it
    return list(tokenizer(glue, add_special_tokens=False)["input_ids"])


@dataclass
class _Conversation:
    row_id: int  # the sample's row id
    system: str | None
    humans: list[str]  # the human turns to answer, in order
    sampled: bool
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: int = 0
    finished: bool = False
    done: bool = False


def converse(
    answer: Answer,
    tokenizer,
    prompts: pl.DataFrame,
    eos_ids: list[int],
    *,
    turns: str = "first",
    samples_per_prompt: int = 0,
    do_sample: bool = False,
    max_prompt_tokens: int | None = None,
    log=lambda msg: None,
) -> tuple[list[dict], dict]:
    """Answer every sample's human turns, turn by turn (see the module doc); return the
    generations rows (GENERATION_SCHEMA, by row id) and the turn loop's counts."""
    later = "later_turns" in prompts.columns and turns == "all"
    if len(prompts) and int(prompts["row_id"].max()) >= SAMPLE_ROW_STRIDE:
        raise ValueError(f"prompt row ids must be below {SAMPLE_ROW_STRIDE:,} (sample row ids add multiples of it)")
    convs: list[_Conversation] = []
    first_ids: dict[int, list[int]] = {}
    for row in prompts.iter_rows(named=True):
        humans = [row["prompt"]] + (list(row["later_turns"] or []) if later else [])
        first_ids[row["row_id"]] = template_ids(tokenizer, row["system"], row["prompt"])
        for s in range(samples_per_prompt + 1):
            convs.append(_Conversation(sample_row_id(row["row_id"], s), row["system"], humans, do_sample or s > 0))
    eos_texts = {i: tokenizer.convert_ids_to_tokens(int(i)) for i in eos_ids}
    counts = {"turns_asked": 0, "turns_over_budget": 0}
    turn = 0
    while True:
        asked = []
        for c in convs:
            if c.done or turn >= len(c.humans):
                continue
            if turn == 0:
                prompt = first_ids[c.row_id % SAMPLE_ROW_STRIDE]
            else:  # an answer cut at max_new_tokens is closed by the template's glue, as in a chat
                eos_text = eos_texts.get(c.ids[-1]) if c.finished else None
                prompt = c.ids + turn_glue_ids(tokenizer, c.system, c.humans[: turn + 1], eos_text)
            if max_prompt_tokens is not None and len(prompt) > max_prompt_tokens:
                counts["turns_over_budget"] += len(c.humans) - turn
                c.done = True
                continue
            asked.append((c, prompt))
        if not asked:
            break
        for sampled in (False, True):
            batch = [(c, p) for c, p in asked if c.sampled == sampled]
            if not batch:
                continue
            answers = answer([(sampling_id(c.row_id, turn), p) for c, p in batch], sampled)
            for (c, p), (ans, finished) in zip(batch, answers):
                c.mask = c.mask + [0] * (len(p) - len(c.ids)) + [1] * len(ans)
                c.ids = p + list(ans)
                c.turns, c.finished = c.turns + 1, bool(finished)
        counts["turns_asked"] += len(asked)
        log(f"turn {turn + 1}: answered {len(asked)} of {len(convs)} samples")
        turn += 1
    rows = [{"row_id": c.row_id, "input_ids": c.ids, "loss_mask": c.mask,
             "prompt_tokens": len(c.mask) - sum(c.mask), "answer_tokens": sum(c.mask),
             "finished": c.finished, "turns": c.turns} for c in convs if c.turns]
    counts["conversations_cut"] = sum(1 for c in convs if c.turns < len(c.humans))
    return rows, counts


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
    turns: str = "first",
    samples_per_prompt: int = 0,
    max_prompt_tokens: int | None = None,
    log=lambda msg: None,
) -> GenerationResult:
    """Answer `prompts` (row_id, system, prompt[, later_turns]) with transformers `generate`
    and write the generations Parquet."""
    eos_ids = eos_token_ids(model, tokenizer)
    answer = transformers_answer(model, tokenizer, eos_ids, batch_size=batch_size, max_new_tokens=max_new_tokens,
                                 temperature=temperature, top_p=top_p, seed=seed)
    start = time.perf_counter()
    rows, counts = converse(answer, tokenizer, prompts, eos_ids, turns=turns, samples_per_prompt=samples_per_prompt,
                            do_sample=do_sample, max_prompt_tokens=max_prompt_tokens, log=log)
    return write_generations(rows, out_path, time.perf_counter() - start, counts)


def transformers_answer(model, tokenizer, eos_ids: list[int], *, batch_size: int, max_new_tokens: int,
                        temperature: float = 1.0, top_p: float = 1.0, seed: int = 0) -> Answer:
    """The transformers engine as an `Answer`: batches of `batch_size` prompts through `generate`,
    stopping at any of `eos_ids`; sampled rows draw from their own noise (`_RowNoise`)."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]

    def answer(batch: list[tuple[int, list[int]]], sampled: bool) -> list[tuple[list[int], bool]]:
        # Similar lengths in a batch waste less compute on padding.
        order = sorted(range(len(batch)), key=lambda i: len(batch[i][1]))
        out: list = [None] * len(batch)
        for b in range(0, len(order), batch_size):
            idx = order[b : b + batch_size]
            answers = generate_batch(model, [batch[i][1] for i in idx], pad_id, eos_ids, max_new_tokens,
                                     do_sample=sampled, temperature=temperature, top_p=top_p,
                                     keys=[row_key(seed, batch[i][0]) for i in idx])
            for i, a in zip(idx, answers):
                out[i] = a
        return out

    return answer


class _RowNoise:
    """A logits processor that makes transformers' greedy step pick what the native engine's
    sampler picks (`native_generate.pick_tokens`: Gumbel-max over temperature and top-p, noise
    hashed from each row's key and answer position), so a row's sample does not depend on its
    batch and is the same in both engines."""

    def __init__(self, keys: list[int], width: int, temperature: float, top_p: float, device):
        from .native_generate import vocab_mixes

        self.keys = torch.tensor(keys, dtype=torch.int64, device=device)
        self.width, self.temperature, self.top_p = width, temperature, top_p
        self.mix = None
        self.vocab_mixes = vocab_mixes

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        from .native_generate import pick_tokens

        t = torch.full((scores.shape[0],), input_ids.shape[1] - self.width, dtype=torch.int64, device=scores.device)
        if self.mix is None:
            self.mix = self.vocab_mixes(scores.shape[-1], scores.device)
        pick = pick_tokens(scores, self.keys, t, self.mix, True, self.temperature, self.top_p)
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(-1, pick[:, None], 0.0)


def row_key(seed: int, sampling_id: int) -> int:
    from .native_generate import row_key as key

    return key(seed, sampling_id)


def generate_batch(
    model, prompts: list[list[int]], pad_id: int, eos_ids: list[int], max_new_tokens: int, *,
    do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0, keys: list[int] | None = None,
) -> list[tuple[list[int], bool]]:
    """One transformers `generate` call over left-padded prompts: (answer, ended with EOS) each.
    Sampling with `keys` (one per prompt) draws each row's tokens from its own noise (`_RowNoise`)."""
    device = next(model.parameters()).device
    width = max(len(ids) for ids in prompts)
    # Left padding: every prompt ends where generation starts.
    input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in prompts], device=device)
    attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts], device=device)
    processors = None
    if do_sample and keys is not None:
        from transformers import LogitsProcessorList

        processors = LogitsProcessorList([_RowNoise(keys, width, temperature, top_p, device)])
        do_sample = False  # the processor samples; transformers' greedy step takes its pick
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
            logits_processor=processors,
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
    """One row of the generations Parquet (GENERATION_SCHEMA) for a one-turn sample."""
    return {
        "row_id": int(row_id),
        "input_ids": list(prompt_ids) + list(answer),
        "loss_mask": [0] * len(prompt_ids) + [1] * len(answer),
        "prompt_tokens": len(prompt_ids),
        "answer_tokens": len(answer),
        "finished": bool(finished),
        "turns": 1,
    }


def write_generations(rows: list[dict], out_path: Path, generate_s: float, counts: dict | None = None) -> GenerationResult:
    """Write the rows (sorted by row_id) atomically; return the shard's totals."""
    df = pl.DataFrame(rows, schema=GENERATION_SCHEMA).sort("row_id")
    atomic_write_parquet(df, Path(out_path))
    return GenerationResult(
        samples=len(rows),
        prompt_tokens=int(df["prompt_tokens"].sum()) if len(rows) else 0,
        answer_tokens=int(df["answer_tokens"].sum()) if len(rows) else 0,
        generate_s=generate_s,
        counts=dict(counts or {}),
    )
