"""Throughput history of the shards: a table over the materialization records, and a chart."""

from __future__ import annotations

from pathlib import Path

import polars as pl


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
