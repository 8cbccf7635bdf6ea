"""Throughput history of the shards: a table over the materialization records, and a chart."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import polars as pl

from .layout import Layout


def shard_history(rows: list[dict]) -> pl.DataFrame:
    """One row per `hidden_states` materialization: when, which shard, and its measured figures."""
    recs = [
        {
            "timestamp": r["timestamp"],
            "shard": r["partition"],
            "run_id": r["run_id"],
            "samples": r["metadata"].get("samples"),
            "tokens": r["metadata"].get("tokens"),
            "tokens_per_s": float(r["metadata"].get("tokens_per_s") or 0.0),
            "bytes_on_disk": r["metadata"].get("bytes_on_disk"),
            "model_load_s": float(r["metadata"].get("model_load_s") or 0.0),
        }
        for r in rows
        if r["asset"] == "hidden_states"
    ]
    schema = {"timestamp": pl.Utf8, "shard": pl.Utf8, "run_id": pl.Utf8, "samples": pl.Int64, "tokens": pl.Int64,
              "tokens_per_s": pl.Float64, "bytes_on_disk": pl.Int64, "model_load_s": pl.Float64}
    return pl.DataFrame(recs, schema=schema)


def throughput_report(rows: list[dict]) -> pl.DataFrame:
    """Per shard: how many extractions ran, the latest and best tokens/s, the latest bytes on disk."""
    latest = pl.col("timestamp").arg_max()
    return (
        shard_history(rows)
        .group_by("shard")
        .agg(
            pl.len().alias("runs"),
            pl.col("samples").get(latest),
            pl.col("tokens").get(latest),
            pl.col("tokens_per_s").get(latest).round(1).alias("latest_tokens_per_s"),
            pl.col("tokens_per_s").max().round(1).alias("best_tokens_per_s"),
            pl.col("tokens_per_s").mean().round(1).alias("mean_tokens_per_s"),
            pl.col("bytes_on_disk").get(latest),
            pl.col("model_load_s").get(latest).round(2),
        )
        .sort("shard")
    )


def plot_history(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    h = shard_history(rows).sort("timestamp")
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for shard in sorted(h["shard"].unique().to_list()):
        s = h.filter(pl.col("shard") == shard).with_row_index("i")
        x = [h["timestamp"].to_list().index(t) for t in s["timestamp"]]
        ax1.plot(x, s["tokens_per_s"], marker="o", label=shard)
        ax2.plot(x, s["bytes_on_disk"], marker="o", label=shard)
    ax1.set_ylabel("tokens/s")
    ax2.set_ylabel("bytes on disk")
    ax2.set_xlabel("hidden_states materialization (in time order)")
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))  # materializations are counted, not measured
    ax1.set_title("Extraction throughput per shard, all runs")
    ax1.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def manifests_summary(hidden_states_root: Path) -> list[tuple]:
    """Per shard on disk now, from the manifests alone (duckdb reads the Parquet files directly):
    (shard, samples, tokens, bytes of sample files)."""
    import duckdb

    pattern = str(hidden_states_root / "*" / "manifest.parquet")
    if not list(hidden_states_root.glob("*/manifest.parquet")):
        return []
    return duckdb.sql(
        f"""
        SELECT regexp_extract(filename, '(rows_[0-9]+-[0-9]+)', 1) AS shard,
               count(*) AS samples, sum(tokens) AS tokens, sum(bytes) AS bytes
        FROM read_parquet('{pattern}', filename = true)
        GROUP BY shard ORDER BY shard
        """
    ).fetchall()


# ---------------------------------------------------------------------------------------------
# Drafters compared: one row per `drafter_eval` materialization (`eagle3 report`, and the
# `comparison` metadata of drafter_eval that the UI shows). Input: the instance's materialization
# records as plain dicts ({asset, timestamp, run_id, metadata}), as `eagle3 history --json` prints.

# The settings that shape a drafter and its measurement (launcher and cache paths do not).
SNAPSHOT_KEYS = ("target_model", "prompts_source", "max_prompts", "max_prompt_tokens", "decontaminate", "shard_size",
                 "storage_root", "generation", "self_prompts", "extraction", "vocab", "training", "eval")


def _source_label(entry) -> str:
    """A prompts_source entry as one short string: the source and what it sets."""
    if isinstance(entry, str):
        return entry
    extra = [f"{k} {v}" for k, v in entry.items() if k != "source" and v not in (None, 0)]
    return entry["source"] + (f" ({', '.join(extra)})" if extra else "")


def settings_snapshot(dump: dict) -> dict:
    """The settings (`Settings.model_dump(mode="json")`) that shape a drafter, flattened to dotted
    keys, with the prompt sources as short strings: what `settings_changes` compares."""
    out: dict = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        else:
            out[prefix] = value

    for key in SNAPSHOT_KEYS:
        if key not in dump:
            continue
        value = dump[key]
        if key == "prompts_source":
            value = [_source_label(e) for e in (value if isinstance(value, list) else [value])]
        walk(key, value)
    return out


def snapshot_sha256(snapshot: dict) -> str:
    return hashlib.sha256(json.dumps(snapshot, sort_keys=True, default=str).encode()).hexdigest()[:16]


def settings_changes(before: dict | None, after: dict | None) -> list[str]:
    """What changed between two snapshots, one "key: old -> new" line per changed key."""
    if not after:
        return ["(no settings recorded)"]
    if before is None:
        return []
    out = []
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key, "(unset)"), after.get(key, "(unset)")
        if old != new:
            out.append(f"{key}: {_short(old)} -> {_short(new)}")
    return out


def _short(value) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)


def drafter_rows(records: list[dict]) -> list[dict]:
    """One row per drafter_eval materialization, in time order: tau per set and category, the data
    behind the drafter, its training, and what changed in the settings since the row before."""
    evals = sorted((r for r in records if r["asset"] == "drafter_eval"), key=lambda r: r["timestamp"])
    rows, previous = [], None
    for n, r in enumerate(evals, 1):
        m = r["metadata"]
        snap = m.get("settings") if isinstance(m.get("settings"), dict) else None
        sets = {k.removeprefix("tau_"): v for k, v in m.items()
                if k.startswith("tau_") and k != "tau_by_category" and isinstance(v, (int, float))}
        storage = "/".join(str(x) for x in (m.get("storage"), m.get("teacher")) if x)
        rows.append({
            "n": n,
            "timestamp": r["timestamp"],
            "run_id": r.get("run_id") or "",
            "tau": m.get("tau"),
            "tau_sets": sets,
            "tau_by_category": m.get("tau_by_category") or {},
            "samples": m.get("samples"),
            "tokens": m.get("tokens"),
            "bytes_on_disk": m.get("bytes_on_disk"),
            "sources": m.get("sources") or [],
            "turns": m.get("turns") or (snap or {}).get("generation.turns"),
            "samples_per_prompt": m.get("samples_per_prompt", (snap or {}).get("generation.samples_per_prompt")),
            "storage": storage or None,
            "data_s": m.get("data_s"),
            "train_s": m.get("train_s"),
            "train_steps": m.get("train_steps"),
            "epochs": m.get("epochs"),
            "changes": ["(first)"] if n == 1 and snap else settings_changes(previous, snap),
        })
        previous = snap if snap is not None else previous
    return rows


def _fmt(value, digits: int = 0) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and digits:
        return f"{value:.{digits}f}"
    if isinstance(value, (int, float)):
        return f"{value:,.0f}"
    return str(value)


def _gb(value) -> str:
    return "-" if value is None else f"{value / 1e9:.2f}"


def _tables(rows: list[dict]) -> list[tuple[str, list[str], list[list[str]]]]:
    """The comparison as (title, header, rows) tables: the drafters, tau per category, the changes."""
    set_names = sorted({s for r in rows for s in r["tau_sets"]})
    main_header = ["#", "when (UTC)", "run", "tau", *[f"tau {s}" for s in set_names], "samples", "tokens", "GB",
                   "data s", "train s", "steps", "epochs", "turns", "samples/prompt", "storage", "sources"]
    main = [[str(r["n"]), r["timestamp"][:16].replace("T", " "), r["run_id"][:8], _fmt(r["tau"], 3),
             *[_fmt(r["tau_sets"].get(s), 3) for s in set_names], _fmt(r["samples"]), _fmt(r["tokens"]),
             _gb(r["bytes_on_disk"]), _fmt(r["data_s"]), _fmt(r["train_s"]), _fmt(r["train_steps"]),
             _fmt(r["epochs"], 2), _fmt(r["turns"]), _fmt(r["samples_per_prompt"]), _fmt(r["storage"]),
             "; ".join(f"{s['source']} {s['rows']:,}" for s in r["sources"]) or "-"]
            for r in rows]
    out = [("Drafters (one row per drafter_eval materialization)", main_header, main)]
    for s in sorted({s for r in rows for s in r["tau_by_category"]}):
        cats = sorted({c for r in rows for c in (r["tau_by_category"].get(s) or {})})
        out.append((f"tau per category, {s}", ["#", *cats],
                    [[str(r["n"]), *[_fmt((r["tau_by_category"].get(s) or {}).get(c), 3) for c in cats]] for r in rows]))
    out.append(("Settings changed since the row before", ["#", "changes"],
                [[str(r["n"]), "; ".join(r["changes"]) or "(none)"] for r in rows]))
    return out


def format_comparison(rows: list[dict]) -> str:
    """The comparison as plain text tables (columns padded with spaces; no dataframe repr)."""
    if not rows:
        return "no drafter_eval materialization in this instance yet"
    blocks = []
    for title, header, body in _tables(rows):
        widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
        lines = [title, "  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
        lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)).rstrip() for b in body]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def comparison_markdown(rows: list[dict]) -> str:
    """The comparison as markdown tables, for drafter_eval's metadata (the UI renders it)."""
    if not rows:
        return "no drafter_eval materialization yet"
    blocks = []
    for title, header, body in _tables(rows):
        def cells(c):
            return "| " + " | ".join(x.replace("|", "\\|") for x in c) + " |"
        blocks.append("\n".join([f"**{title}**", "", cells(header), "| " + " | ".join("---" for _ in header) + " |",
                                 *map(cells, body)]))
    return "\n\n".join(blocks)


def drafter_record(now: dict, drafter: dict, prompts: dict, shards_now: list[tuple], shard_metadata: list[tuple]) -> dict:
    """What `eagle3 report` compares drafters by: the settings the drafter was trained with (its
    own record, `drafter`'s "settings"; the evaluation's from `now`, a `settings_snapshot`), the
    data behind it (`shards_now` from `manifests_summary`; each shard's latest generation and
    extraction metadata in `shard_metadata`, as pairs) and its training."""
    trained = drafter.get("settings") if isinstance(drafter.get("settings"), dict) else None
    snapshot = {**{k: v for k, v in (trained or now).items() if not k.startswith("eval.")},
                **{k: v for k, v in now.items() if k.startswith("eval.")}}
    data_s = 0.0
    for g, h in shard_metadata:
        data_s += float(g.get("generate_s") or 0) + float(g.get("model_load_s") or 0)
        data_s += float(h.get("job_s") or h.get("extract_s") or 0)
    return {
        "settings": snapshot,
        "settings_sha256": snapshot_sha256(snapshot),
        "settings_from": "drafter" if trained else "current settings (the drafter recorded none)",
        "samples": sum(s[1] for s in shards_now),
        "tokens": sum(s[2] for s in shards_now),
        "bytes_on_disk": sum(s[3] for s in shards_now),
        "shards": len(shards_now),
        "sources": [{"source": s["source"], "rows": s["rows"]} for s in prompts.get("sources") or []],
        "turns": snapshot.get("generation.turns", "first"),
        "samples_per_prompt": snapshot.get("generation.samples_per_prompt", 0),
        "storage": snapshot.get("extraction.storage", "bf16"),
        "teacher": snapshot.get("extraction.teacher", "last_hidden"),
        "data_s": round(data_s, 1),
        **{k: drafter[src] for k, src in (("train_s", "train_s"), ("train_steps", "steps"), ("epochs", "epochs"))
           if src in drafter},
    }


def eval_summary(r: dict, num_draft_tokens: int, device: str, card: str, record: dict, paths: Layout) -> dict:
    """`drafter_eval`'s metadata as plain values, in the order the UI shows them: the evaluation's
    result `r` (its eval.json) rounded, the model `card` and the `drafter_record`."""
    from .model_card import CARD_NAME  # here: model_card imports torch, and `eagle3 report` reads this module

    speed = [f"{k}_b{b}" for b in r.get("speedup_batches", [])
             for k in ("speedup", "greedy_tok_s", "spec_tok_s", "speedup_prompts")]
    optional = {k: round(r[k], 3) if isinstance(r[k], float) else r[k]
                for k in (*speed, "greedy_check_matches", "greedy_check_prompts") if k in r}
    return {
        "tau": round(r["tau"], 4),
        **{f"tau_{name}": round(s["tau"], 4) for name, s in r["sets"].items()},
        **{f"acceptance_pos_{i}": round(a, 4) for i, a in enumerate(r["per_position_acceptance"])},
        "per_position_acceptance": [round(a, 4) for a in r["per_position_acceptance"]],
        "tau_by_category": {name: {c: round(t, 4) for c, t in s["tau_by_category"].items()} for name, s in r["sets"].items()},
        "prompts_used": r["prompts_used"],
        "new_tokens": r["new_tokens"],
        "verify_steps": r["verify_steps"],
        **optional,
        "num_draft_tokens": num_draft_tokens,
        "prompt_sets": list(r["sets"]),
        "speedup_batches": r.get("speedup_batches", []),
        "engine": r["engine"],
        "batch_size": r["batch_size"],
        "workers": r["workers"],
        "dtype": r["dtype"],
        "device": device,  # `eagle3 plan` times a run from the same kind
        **{k: round(r[k], 2) for k in ("load_s", "acceptance_s", "speedup_s", "check_s", "eval_s")},
        "path": str(paths.drafter_eval),
        "model_card": card,
        **record,
        "model_card_path": str(paths.drafter / CARD_NAME),
    }
