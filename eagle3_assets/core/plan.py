"""`eagle3 plan`: before anything runs, what the extraction will write, where, and for how long.

Per shard and in total: samples, tokens, bytes in the chosen file layout, and time; the free
space where the files go; and what the other layouts would take. The bytes are
`SampleLayout.predict_bytes`, the one prediction that the extraction job's disk preflight
checks and the shard check compares with the disk.

Tokens come from the best source there is, named per shard:
- "generations": the shard's generations file (exact);
- "prompt_lengths": the prompts table's templated prompt lengths + `max_new_tokens` per answer
  (an upper bound: answers may stop before `max_new_tokens`; with `generation.turns: all`, each
  turn's templated length and an answer per earlier turn, at most `max_prompt_tokens`), times
  1 + `samples_per_prompt`;
- "prompt_table": no prompts table yet: the table as the prompts step would read it (before
  decontamination; a `generator:self` row counts `self_prompts.max_tokens`), bounded as above;
- "prompt_count": no prompts table yet: the prompt file's usable prompts x (`max_prompt_tokens`
  + `max_new_tokens`) (a loose upper bound; materialize `prompts` for a closer one).

The time is tokens / the last measured tokens/s of a `hidden_states` materialization in the
instance (`eagle3 history`), preferring one of the same layout, plus its model load per shard;
with no history, the disk ceiling measured on the H200 (a lower bound on the time).
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import polars as pl

from .layout import Layout
from .sample_files import MANIFEST, STORAGES, TEACHERS, SampleLayout
from .shards import shard_keys, shard_range
from .files import bytes_on_disk

# fsync'd sequential writes on the H200 node (REFERENCE.md, 2026-12-02): what a disk-bound
# extraction cannot beat, whatever the model.
DISK_CEILING_BYTES_PER_S = 1.30e9
TOKEN_SOURCES = {
    "generations": "the shard's generations (exact)",
    "prompt_lengths": "templated prompt lengths + max_new_tokens per sample (an upper bound)",
    "prompt_table": "no prompts table yet: the prompts as the prompts step reads them (not decontaminated), "
                    "templated lengths + max_new_tokens per answer (an upper bound)",
    "prompt_count": "no prompts table yet: prompts x (max_prompt_tokens + max_new_tokens) (a loose upper bound)",
}


@dataclass(frozen=True)
class ShardTokens:
    shard: str
    samples: int
    tokens: int
    source: str  # a key of TOKEN_SOURCES


@dataclass(frozen=True)
class Rate:
    tokens_per_s: float
    model_load_s: float  # per shard (each shard's job loads the target)
    source: str


def shard_tokens(
    paths: Layout,
    shard_size: int,
    max_new_tokens: int,
    max_prompt_tokens: int,
    prompt_lengths: Callable[[pl.DataFrame], list[int]],
    prompt_count: Callable[[], int],
    samples_per_prompt: int = 0,
    prompt_table: Callable[[], pl.DataFrame | None] | None = None,
) -> list[ShardTokens]:
    """Samples and tokens of every shard, from the best source there is (see the module doc).
    `prompt_lengths(rows)` gives the prompt tokens of each prompts-table row (with every turn
    answered: its turns' and earlier answers', at most `max_prompt_tokens`); `prompt_count()` the
    number of usable prompts in the prompt file; `prompt_table()`, when given, the prompts table as
    the prompts step would make it, used while there is none on disk. Each prompt makes
    1 + `samples_per_prompt` samples."""
    per_prompt = 1 + samples_per_prompt
    table = prompt_table() if prompt_table is not None and not paths.prompts.is_file() else None
    if table is None and not paths.prompts.is_file():
        n = prompt_count()
        per_sample = max_prompt_tokens + max_new_tokens
        return [ShardTokens(k, (e - s) * per_prompt, (e - s) * per_prompt * per_sample, "prompt_count")
                for k in shard_keys(n, shard_size) for s, e in [shard_range(k)]]
    prompts = table if table is not None else pl.read_parquet(paths.prompts)
    source = "prompt_table" if table is not None else "prompt_lengths"
    out = []
    for key in shard_keys(len(prompts), shard_size):
        generations = paths.generations(key)
        if table is None and generations.is_file():
            lengths = pl.read_parquet(generations, columns=["input_ids"])["input_ids"].list.len()
            out.append(ShardTokens(key, len(lengths), int(lengths.sum()), "generations"))
        else:
            start, end = shard_range(key)
            lengths = prompt_lengths(prompts.filter(pl.col("row_id").is_between(start, end, closed="left")))
            out.append(ShardTokens(key, len(lengths) * per_prompt,
                                   (sum(lengths) + len(lengths) * max_new_tokens) * per_prompt, source))
    return out


def measured_rate(history: list[dict], layout: SampleLayout) -> Rate | None:
    """The latest measured extraction rate in the history (`eagle3 history` rows), preferring a
    materialization of the same storage and teacher; None when nothing was measured."""
    measured = [r for r in history if r["asset"] == "hidden_states" and (r["metadata"].get("tokens_per_s") or 0) > 0]

    def layout_of(r) -> tuple[str, str]:  # materializations from before the layouts wrote bf16/last_hidden
        return r["metadata"].get("storage", "bf16"), r["metadata"].get("teacher", "last_hidden")

    same = [r for r in measured if layout_of(r) == (layout.storage, layout.teacher)]
    if not measured:
        return None
    r = max(same or measured, key=lambda r: r["timestamp"])
    m = r["metadata"]
    other = "" if same else f", layout {'/'.join(layout_of(r))} (none measured in {layout.storage}/{layout.teacher})"
    return Rate(float(m["tokens_per_s"]), float(m.get("model_load_s") or 0.0),
                f"measured: hidden_states[{r['partition']}] at {r['timestamp'][:19]}, {m['tokens_per_s']:,.0f} tok/s{other}")


def ceiling_rate(layout: SampleLayout) -> Rate:
    tokens_per_s = DISK_CEILING_BYTES_PER_S / layout.bytes_per_token()
    return Rate(tokens_per_s, 0.0,
                f"no measured extraction in the history: the H200 disk ceiling, {DISK_CEILING_BYTES_PER_S / 1e9:.2f} GB/s "
                f"/ {layout.bytes_per_token():,} B per token = {tokens_per_s:,.0f} tok/s, no model load (a lower bound on time)")


def free_bytes(path: Path) -> tuple[Path, int]:
    """Free bytes of the filesystem `path` is (or will be) on: its nearest existing folder's."""
    path = Path(path).resolve()
    while not path.exists():
        path = path.parent
    return path, shutil.disk_usage(path).free


def make_plan(shards: list[ShardTokens], layout: SampleLayout, where: Path, rate: Rate) -> dict:
    """The plan as plain data (what `--json` prints): per shard and in total, the layout, the
    free space at `where` (the hidden_states folder) and the other layouts' totals."""
    where = Path(where)
    rows = []
    for s in shards:
        shard_dir = where / s.shard
        complete = (shard_dir / MANIFEST).is_file()
        rows.append({
            **asdict(s),
            "bytes": layout.predict_bytes(s.tokens, s.samples),
            "tensor_bytes": s.tokens * layout.bytes_per_token(),
            "bytes_on_disk": bytes_on_disk(shard_dir),
            "complete": complete,  # extracted already (its manifest is there): no time, no new bytes
            "time_s": 0.0 if complete else rate.model_load_s + s.tokens / rate.tokens_per_s,
        })
    total = {key: sum(r[key] for r in rows) for key in ("samples", "tokens", "bytes", "tensor_bytes", "bytes_on_disk", "time_s")}
    # Bytes still to write: what each shard lacks (a rerun keeps its valid files).
    total["bytes_to_write"] = sum(0 if r["complete"] else max(0, r["bytes"] - r["bytes_on_disk"]) for r in rows)
    folder, free = free_bytes(where)
    alternatives = []
    for storage in STORAGES:
        for teacher in TEACHERS:
            other = SampleLayout(layout.hidden_size, layout.dtype, storage, teacher, layout.topk)
            alternatives.append({"layout": other.name, "storage": storage, "teacher": teacher,
                                 "bytes_per_token": other.bytes_per_token(),
                                 "bytes": other.predict_bytes(total["tokens"], total["samples"]),
                                 "share_of_bf16_last_hidden": round(other.bytes_per_token()
                                                                    / SampleLayout(layout.hidden_size).bytes_per_token(), 4)})
    return {
        "layout": {"name": layout.name, "storage": layout.storage, "teacher": layout.teacher,
                   **({"topk": layout.topk} if layout.teacher == "topk" else {}),
                   "hidden_size": layout.hidden_size, "bytes_per_token": layout.bytes_per_token(),
                   "format_version": layout.format_version},
        "where": str(where),
        "free_bytes": free,
        "free_bytes_of": str(folder),
        "fits": total["bytes_to_write"] <= free,
        "tokens_per_s": rate.tokens_per_s,
        "model_load_s": rate.model_load_s,
        "rate_source": rate.source,
        "token_sources": {key: TOKEN_SOURCES[key] for key in sorted({s.source for s in shards})},
        "shards": rows,
        "total": total,
        "alternatives": alternatives,
    }


def format_plan(plan: dict) -> str:
    """The plan as the table `eagle3 plan` prints."""
    lay = plan["layout"]
    lines = [f"eagle3 plan: layout {lay['name']} (format {lay['format_version']}), hidden size {lay['hidden_size']:,}, "
             f"{lay['bytes_per_token']:,} bytes per token",
             f"{'shard':<20} {'samples':>8} {'tokens':>13} {'tokens from':<15} {'bytes':>17} {'on disk now':>15} {'time':>10}"]
    for r in plan["shards"]:
        time_cell = "done" if r["complete"] else _duration(r["time_s"])
        lines.append(f"{r['shard']:<20} {r['samples']:>8,} {r['tokens']:>13,} {r['source']:<15} {r['bytes']:>17,} "
                     f"{r['bytes_on_disk']:>15,} {time_cell:>10}")
    t = plan["total"]
    lines.append(f"{'total':<20} {t['samples']:>8,} {t['tokens']:>13,} {'':<15} {t['bytes']:>17,} "
                 f"{t['bytes_on_disk']:>15,} {_duration(t['time_s']):>10}")
    lines.append(f"bytes: {t['bytes'] / 1e9:,.2f} GB ({t['tensor_bytes']:,} of tensors + a header bound per file); "
                 f"still to write {t['bytes_to_write'] / 1e9:,.2f} GB")
    lines.append(f"free where they go ({plan['free_bytes_of']}): {plan['free_bytes'] / 1e9:,.2f} GB -> "
                 + ("fits" if plan["fits"] else "DOES NOT FIT: free space, choose a smaller layout, or set storage_root"))
    lines.append(f"time at {plan['tokens_per_s']:,.0f} tok/s + {plan['model_load_s']:.0f} s model load per shard "
                 f"({plan['rate_source']})")
    for key, text in plan["token_sources"].items():
        lines.append(f"tokens from {key}: {text}")
    lines.append("other layouts for the same tokens:")
    for a in plan["alternatives"]:
        mark = "  <- chosen" if (a["storage"], a["teacher"]) == (lay["storage"], lay["teacher"]) else ""
        lines.append(f"  {a['layout']:<18} {a['bytes_per_token']:>8,} B/token {a['bytes'] / 1e9:>12,.2f} GB "
                     f"({a['share_of_bf16_last_hidden']:.1%} of bf16/last_hidden){mark}")
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
