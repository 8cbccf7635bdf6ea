"""Decontamination: training prompts that overlap an evaluation set are dropped before shards are cut.

A drafter trained on the questions it is measured on reports a tau it will not reach in
service. Texts are compared as lower-case word sequences (runs of letters and digits):

- two texts overlap when they share a word 13-gram;
- when either is short (fewer than 13 words, so it has no 13-gram) they overlap when they
  share a word 8-gram;
- a text of fewer than 8 words overlaps only a text of the same words (a short question
  such as "write a poem" inside a longer prompt is not that question).

The evaluation texts are every turn of the 80 MT-bench questions (first AND later turns, as
`generation.turns: all` trains on later turns) and the user turns of every `eval.prompt_sets`
file. A training conversation is dropped when any of its human turns overlaps any of them.
"""

from __future__ import annotations

import re
from typing import Iterable

from .evaluate import MT_BENCH, load_mtbench_questions, load_prompt_set

NGRAM = 13
SHORT_NGRAM = 8
_WORD = re.compile(r"\w+")


def words(text: str) -> tuple[str, ...]:
    return tuple(_WORD.findall(text.lower()))


def _grams(w: tuple[str, ...], n: int) -> Iterable[tuple[str, ...]]:
    return (w[i : i + n] for i in range(len(w) - n + 1))


class Decontaminator:
    """Answers `contaminated(texts)` against a fixed set of evaluation texts."""

    def __init__(self, eval_texts: Iterable[str]):
        self.long: set[tuple[str, ...]] = set()  # 13-grams of the evaluation texts
        self.short_of_all: set[tuple[str, ...]] = set()  # 8-grams of every evaluation text
        self.short_of_short: set[tuple[str, ...]] = set()  # 8-grams of the short evaluation texts
        self.whole: set[tuple[str, ...]] = set()  # the evaluation texts under 8 words
        self.count = 0
        for text in eval_texts:
            w = words(text)
            if not w:
                continue
            self.count += 1
            self.long.update(_grams(w, NGRAM))
            grams = set(_grams(w, SHORT_NGRAM))
            self.short_of_all |= grams
            if len(w) < NGRAM:
                self.short_of_short |= grams
            if len(w) < SHORT_NGRAM:
                self.whole.add(w)

    def overlaps(self, text: str) -> bool:
        w = words(text)
        if len(w) < SHORT_NGRAM:  # a few words ("hi", "go on") overlap only by being the same text
            return w in self.whole
        if len(w) < NGRAM:
            return any(g in self.short_of_all for g in _grams(w, SHORT_NGRAM))
        return (any(g in self.long for g in _grams(w, NGRAM))
                or any(g in self.short_of_short for g in _grams(w, SHORT_NGRAM)))

    def contaminated(self, texts: list[str]) -> bool:
        return any(self.overlaps(t) for t in texts)


def eval_texts(prompt_sets: list[str]) -> list[str]:
    """Every evaluation text of the configured sets: all MT-bench turns for `embedded:mt-bench`,
    the user turns of each prompt file."""
    out: list[str] = []
    for source in prompt_sets:
        if source == MT_BENCH:
            out += [turn for q in load_mtbench_questions() for turn in q["turns"]]
        else:
            out += [p.prompt for p in load_prompt_set(source)]
    return out
