"""`eagle3 plan`: before anything runs, what the run will write, where, and for how long.

Per shard and in total: samples, tokens, bytes in the chosen file layout, and time; the free
space where the files go; and what the other layouts would take. The bytes are
`SampleLayout.predict_bytes`, the one prediction that the extraction job's disk preflight
checks and the shard check compares with the disk.

The plan is of what these settings will build: the prompts table on disk only when `eagle3 run`
would keep it (else the table the settings make, built here), and a shard counts as done only
when `eagle3 run` would not extract it again (a stale shard, after a storage or teacher change,
is to be written, whole). Tokens come from the best source there is, named per shard:
- "generations": the shard's generations file, when `eagle3 run` keeps it (exact);
- "prompt_lengths": the templated prompt lengths + `max_new_tokens` per sample (an upper bound:
  answers may stop before `max_new_tokens`).

Time is estimated per stage (generation, extraction, training, evaluation) from the latest
materialization of that stage in the instance's history (`eagle3 history`) on the same kind of
device (cpu, cuda); with none, it is unknown, and the plan says so rather than guess.
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

TOKEN_SOURCES = {
    "generations": "the shard's generations (exact)",
    "prompt_lengths": "templated prompt lengths + max_new_tokens per sample (an upper bound)",
}


@dataclass(frozen=True)
class ShardTokens:
    shard: str
    samples: int
    tokens: int
    source: str  # a key of TOKEN_SOURCES
    redo: str | None = None  # why `eagle3 run` extracts it again though its files are there (stale)


@dataclass(frozen=True)
class Rate:
    tokens_per_s: float
    model_load_s: float  # per shard (each shard's share of its run's load)
    source: str


def shard_tokens(
    paths: Layout,
    shard_size: int,
    max_new_tokens: int,
    prompt_lengths: Callable[[pl.DataFrame], list[int]],
    prompts: pl.DataFrame | None = None,
    pending: Callable[[str, str], str | None] | None = None,
) -> list[ShardTokens]:
    """Samples and tokens of every shard, from the best source there is (see the module doc).
    `prompts`: the table the settings will build, when `eagle3 run` will not keep the one on disk
    (None: the one on disk); `prompt_lengths(rows)` gives the templated prompt length of each of
    its rows. `pending(asset, shard)` says why `eagle3 run` would (re)materialize that shard of
    that asset, or None (judged from the instance); without it, what is on disk counts as current."""
    rebuilt = prompts is not None
    table = prompts if rebuilt else pl.read_parquet(paths.prompts)
    out = []
    for key in shard_keys(len(table), shard_size):
        extracted = (paths.hidden_states(key) / MANIFEST).is_file()
        if rebuilt:  # new prompts: new answers and new files for every shard
            redo = "the prompts table will be rebuilt" if extracted else None
            keep_generations = False
        else:
            redo = pending("hidden_states", key) if pending and extracted else None
            keep_generations = paths.generations(key).is_file() and (pending is None or pending("generations", key) is None)
        if keep_generations:
            lengths = pl.read_parquet(paths.generations(key), columns=["input_ids"])["input_ids"].list.len()
            out.append(ShardTokens(key, len(lengths), int(lengths.sum()), "generations", redo))
        else:
            start, end = shard_range(key)
            lengths = prompt_lengths(table.filter(pl.col("row_id").is_between(start, end, closed="left")))
            out.append(ShardTokens(key, len(lengths), sum(lengths) + len(lengths) * max_new_tokens, "prompt_lengths", redo))
    return out


def device_kind(device: str | None) -> str:
    """"cuda:0", "cuda" -> "cuda"; "cpu" -> "cpu": what a rate measured on one device says of another."""
    return str(device or "unknown").split(":")[0]


def _latest(history: list[dict], asset: str, kind: str, ok=lambda m: True) -> dict | None:
    rows = [r for r in history if r["asset"] == asset and device_kind(r["metadata"].get("device")) == kind
            and ok(r["metadata"])]
    return max(rows, key=lambda r: r["timestamp"]) if rows else None


def _where(r: dict) -> str:
    return f"{r['asset']}{'[' + r['partition'] + ']' if r['partition'] else ''} at {r['timestamp'][:19]}"


def measured_rate(history: list[dict], layout: SampleLayout, kind: str | None = None) -> Rate | None:
    """The latest measured extraction rate in the history (`eagle3 history` rows) on the device
    kind `kind` (None: any), preferring a materialization of the same storage and teacher; None
    when nothing was measured there."""
    measured = [r for r in history if r["asset"] == "hidden_states" and (r["metadata"].get("tokens_per_s") or 0) > 0
                and (kind is None or device_kind(r["metadata"].get("device")) == kind)]

    def layout_of(r) -> tuple[str, str]:  # materializations from before the layouts wrote bf16/last_hidden
        return r["metadata"].get("storage", "bf16"), r["metadata"].get("teacher", "last_hidden")

    same = [r for r in measured if layout_of(r) == (layout.storage, layout.teacher)]
    if not measured:
        return None
    r = max(same or measured, key=lambda r: r["timestamp"])
    m = r["metadata"]
    other = "" if same else f", layout {'/'.join(layout_of(r))} (none measured in {layout.storage}/{layout.teacher})"
    return Rate(float(m["tokens_per_s"]), float(m.get("model_load_s") or 0.0),
                f"measured: hidden_states[{r['partition']}] at {r['timestamp'][:19]}"
                f"{' on ' + kind if kind else ''}, {m['tokens_per_s']:,.0f} tok/s{other}")


@dataclass(frozen=True)
class StageWork:
    """What one run of the graph asks of each stage, for `stage_times`."""

    kinds: dict[str, str]  # stage -> device kind it runs on
    generate_samples: int  # samples still to answer
    generate_shards: int
    max_new_tokens: int
    train_tokens: int | None  # tokens training will read (None: no training to do)
    time_budget_s: float | None
    eval_prompts: int | None  # prompts the evaluation decodes (None: no evaluation to do)


def stage_times(history: list[dict], work: StageWork, extraction_s: float | None, extraction_basis: str) -> list[dict]:
    """Each stage's time, estimated from the latest materialization of that stage on the same
    kind of device in the history; unknown (None) when there is none."""
    out = []

    def add(stage: str, todo: str, time_s: float | None, basis: str) -> None:
        out.append({"stage": stage, "todo": todo, "time_s": time_s, "basis": basis})

    def unknown(asset: str) -> str:
        return f"unknown: no {asset} materialization on {work.kinds[asset]} in the history"

    if work.generate_samples:
        todo = f"{work.generate_samples:,} samples in {work.generate_shards} shard(s)"
        r = _latest(history, "generations", work.kinds["generations"],
                    lambda m: (m.get("tokens_per_s") or 0) > 0 and not m.get("reused"))
        if r is None:
            add("generations", todo, None, unknown("generations"))
        else:
            m = r["metadata"]
            answers = work.generate_samples * work.max_new_tokens
            add("generations", todo, answers / m["tokens_per_s"] + work.generate_shards * float(m.get("model_load_s") or 0),
                f"{_where(r)}: {m['tokens_per_s']:,.0f} answer tok/s and a {float(m.get('model_load_s') or 0):.0f} s "
                f"load per shard; answers taken at max_new_tokens ({work.max_new_tokens}): an upper bound")
    add("hidden_states", "see the shards above", extraction_s, extraction_basis)
    if work.train_tokens is not None:
        r = _latest(history, "drafter", work.kinds["drafter"], lambda m: (m.get("tokens_per_s") or 0) > 0)
        budget = f"; training stops at time_budget_s = {work.time_budget_s:,.0f} s" if work.time_budget_s else ""
        todo = f"{work.train_tokens:,} tokens"
        if r is None:
            add("drafter", todo, None, unknown("drafter") + budget)
        else:
            rate = r["metadata"]["tokens_per_s"]
            t = work.train_tokens / rate
            add("drafter", todo, min(t, work.time_budget_s) if work.time_budget_s else t,
                f"{_where(r)}: {rate:,.0f} training tok/s{budget}")
    if work.eval_prompts is not None:
        r = _latest(history, "drafter_eval", work.kinds["drafter_eval"],
                    lambda m: (m.get("eval_s") or 0) > 0 and (m.get("prompts_used") or 0) > 0)
        todo = f"{work.eval_prompts:,} prompts"
        if r is None:
            add("drafter_eval", todo, None, unknown("drafter_eval"))
        else:
            m = r["metadata"]
            add("drafter_eval", todo, m["eval_s"] * work.eval_prompts / m["prompts_used"],
                f"{_where(r)}: {m['eval_s']:,.0f} s for {m['prompts_used']} prompts, scaled to {work.eval_prompts}")
    return out


def free_bytes(path: Path) -> tuple[Path, int]:
    """Free bytes of the filesystem `path` is (or will be) on: its nearest existing folder's."""
    path = Path(path).resolve()
    while not path.exists():
        path = path.parent
    return path, shutil.disk_usage(path).free


def make_plan(shards: list[ShardTokens], layout: SampleLayout, where: Path, rate: Rate | None,
              stages: list[dict] | None = None) -> dict:
    """The plan as plain data (what `--json` prints): per shard and in total, the layout, the
    free space at `where` (the hidden_states folder) and the other layouts' totals; `rate` None:
    no extraction rate known, the time is unknown (None). `stages`: `stage_times`' estimates."""
    where = Path(where)
    rows = []
    for s in shards:
        shard_dir = where / s.shard
        # Extracted already and not to be redone (its manifest is there, and it is not stale): no time, no new bytes.
        complete = (shard_dir / MANIFEST).is_file() and s.redo is None
        rows.append({
            **asdict(s),
            "bytes": layout.predict_bytes(s.tokens, s.samples),
            "tensor_bytes": s.tokens * layout.bytes_per_token(),
            "bytes_on_disk": bytes_on_disk(shard_dir),
            "complete": complete,
            "time_s": 0.0 if complete else None if rate is None else rate.model_load_s + s.tokens / rate.tokens_per_s,
        })
    total = {key: sum(r[key] for r in rows) for key in ("samples", "tokens", "bytes", "tensor_bytes", "bytes_on_disk")}
    times = [r["time_s"] for r in rows]
    total["time_s"] = None if None in times else sum(times)
    # Bytes still to write: what an unfinished shard lacks (a rerun keeps its valid files); all of a
    # stale one (its files are of other settings).
    total["bytes_to_write"] = sum(0 if r["complete"] else r["bytes"] if r["redo"] else max(0, r["bytes"] - r["bytes_on_disk"])
                                  for r in rows)
    stages = stages or []
    stage_s = [st["time_s"] for st in stages]
    total["run_time_s"] = None if not stages or None in stage_s else sum(stage_s)
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
        "tokens_per_s": rate.tokens_per_s if rate else None,
        "model_load_s": rate.model_load_s if rate else None,
        "rate_source": rate.source if rate else "unknown: no extraction measured on this kind of device in the history",
        "stages": stages,
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
             *([f"prompts: {plan['prompts_table']}"] if plan.get("prompts_table") else []),
             f"{'shard':<20} {'samples':>8} {'tokens':>13} {'tokens from':<15} {'bytes':>17} {'on disk now':>15} {'time':>10}"]
    for r in plan["shards"]:
        time_cell = "done" if r["complete"] else ("stale " if r["redo"] else "") + _duration(r["time_s"])
        lines.append(f"{r['shard']:<20} {r['samples']:>8,} {r['tokens']:>13,} {r['source']:<15} {r['bytes']:>17,} "
                     f"{r['bytes_on_disk']:>15,} {time_cell:>10}")
    t = plan["total"]
    lines.append(f"{'total':<20} {t['samples']:>8,} {t['tokens']:>13,} {'':<15} {t['bytes']:>17,} "
                 f"{t['bytes_on_disk']:>15,} {_duration(t['time_s']):>10}")
    lines.append(f"bytes: {t['bytes'] / 1e9:,.2f} GB ({t['tensor_bytes']:,} of tensors + a header bound per file); "
                 f"still to write {t['bytes_to_write'] / 1e9:,.2f} GB")
    lines.append(f"free where they go ({plan['free_bytes_of']}): {plan['free_bytes'] / 1e9:,.2f} GB -> "
                 + ("fits" if plan["fits"] else "DOES NOT FIT: free space, choose a smaller layout, or set storage_root"))
    if plan["tokens_per_s"]:
        lines.append(f"extraction time at {plan['tokens_per_s']:,.0f} tok/s + {plan['model_load_s']:.0f} s model load "
                     f"per shard ({plan['rate_source']})")
    else:
        lines.append(f"extraction time: {plan['rate_source']}")
    for r in plan["shards"]:
        if r["redo"] and not r["complete"]:
            lines.append(f"{r['shard']} is extracted again: {r['redo']}")
    if plan["stages"]:
        lines.append("time per stage (what this run does):")
        for st in plan["stages"]:
            lines.append(f"  {st['stage']:<14} {_duration(st['time_s']):>10}  {st['todo']}; {st['basis']}")
        lines.append(f"  {'in all':<14} {_duration(t['run_time_s']):>10}")
    for key, text in plan["token_sources"].items():
        lines.append(f"tokens from {key}: {text}")
    lines.append("other layouts for the same tokens:")
    for a in plan["alternatives"]:
        mark = "  <- chosen" if (a["storage"], a["teacher"]) == (lay["storage"], lay["teacher"]) else ""
        lines.append(f"  {a['layout']:<18} {a['bytes_per_token']:>8,} B/token {a['bytes'] / 1e9:>12,.2f} GB "
                     f"({a['share_of_bf16_last_hidden']:.1%} of bf16/last_hidden){mark}")
    return "\n".join(lines)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
