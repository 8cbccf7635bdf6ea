"""An asset's materializations as the instance recorded them: one reader for the CLI, the planner
and the assets (the latest of an asset or of one of its partitions, its metadata as plain values,
and every one of them)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Iterator

from dagster import AssetKey, AssetRecordsFilter, DagsterInstance


def latest(instance: DagsterInstance, asset: str | AssetKey, partition: str | None = None):
    """The latest materialization record of `asset` (of its `partition` when given), or None."""
    key = asset if isinstance(asset, AssetKey) else AssetKey(asset)
    flt = AssetRecordsFilter(asset_key=key, asset_partitions=[partition] if partition else None)
    records = instance.fetch_materializations(flt, limit=1).records
    return records[0] if records else None


def values(metadata) -> dict:
    """Metadata as plain values (a `MetadataValue`'s `.value`)."""
    return {k: getattr(v, "value", v) for k, v in metadata.items()}


def latest_metadata(instance: DagsterInstance, asset: str | AssetKey, partition: str | None = None) -> dict:
    """The latest materialization's metadata as plain values; {} when there is none."""
    record = latest(instance, asset, partition)
    return values(record.asset_materialization.metadata) if record is not None else {}


def materializations(instance: DagsterInstance, asset: str | AssetKey) -> Iterator:
    """Every materialization record of `asset`, a page at a time."""
    key = asset if isinstance(asset, AssetKey) else AssetKey(asset)
    cursor = None
    while True:
        res = instance.fetch_materializations(AssetRecordsFilter(asset_key=key), limit=1000, cursor=cursor)
        yield from res.records
        if not res.has_more:
            return
        cursor = res.cursor


def plain_records(instance: DagsterInstance, asset: str, run_id: str | None = None, metadata: dict | None = None) -> list[dict]:
    """Every materialization of `asset` as a plain dict ({asset, timestamp, run_id, metadata}); with
    `metadata`, one more, last: the one run `run_id` is about to record (timestamped now)."""
    out = [{"asset": asset, "run_id": r.run_id, "timestamp": datetime.fromtimestamp(r.timestamp, timezone.utc).isoformat(),
            "metadata": values(r.asset_materialization.metadata)} for r in materializations(instance, asset)]
    if metadata is not None:
        out.append({"asset": asset, "timestamp": datetime.now(timezone.utc).isoformat(), "run_id": run_id, "metadata": metadata})
    return out
