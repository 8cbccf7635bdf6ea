"""Every use of Dagster's private modules (`dagster._...`), in one place.

Dagster documents no public API for these; each is pinned by `eagle3_assets_tests/test_dagster_compat.py`
to the Dagster version it was checked against, so an upgrade that moves one fails there, in one test,
not deep inside `eagle3 run`. Nothing else in the package imports `dagster._`.

- `RANGE_START_TAG`, `RANGE_END_TAG`: the run tags that make one run cover a range of partitions
  (what a UI backfill with `BackfillPolicy.single_run()` sets). `eagle3 run` sets them itself to
  extract a range of shards with one model load; Dagster exports no name for them.
- `CODE_VERSION_TAG`, `DATA_VERSION_TAG`: the tags a materialization carries its versions in.
- `version_tags`: the data-version tags Dagster gives an asset's own output. `hidden_states`
  reports the good shards of a partly failed run as `AssetMaterialization` events, which Dagster
  does not tag; without the tags those shards would read as stale at once.
- `stale_causes`: whether an asset (partition) is stale and why: its code version or an input's
  data version changed. The UI computes this with `CachingStaleStatusResolver`; the public API
  offers no query for it outside GraphQL.
- `PipesExecutionError`: what `PipesSubprocessClient` raises when its process fails; the launcher's
  own client raises the same, so a failed job reads the same in the run log.
"""

from __future__ import annotations

from dagster import AssetKey, DagsterInstance, DataVersion, Definitions
from dagster._core.definitions.data_version import (
    CODE_VERSION_TAG,
    DATA_VERSION_TAG,
    DEFAULT_DATA_VERSION,
    CachingStaleStatusResolver,
    StaleStatus,
    compute_logical_data_version,
    get_input_data_version_tag,
    get_input_event_pointer_tag,
)
from dagster._core.errors import DagsterPipesExecutionError as PipesExecutionError
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG as RANGE_END_TAG
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_START_TAG as RANGE_START_TAG

__all__ = ["CODE_VERSION_TAG", "DATA_VERSION_TAG", "PipesExecutionError", "RANGE_END_TAG", "RANGE_START_TAG",
           "stale_causes", "version_tags"]


def version_tags(code_version: str, inputs: dict[AssetKey, tuple[str | None, int | None]]) -> dict[str, str]:
    """The data-version tags of an output with `code_version` that read `inputs`: for each input
    key, (its recorded data version or None, the storage id of the materialization read or None)."""
    tags, versions = {CODE_VERSION_TAG: code_version}, {}
    for key, (recorded, storage_id) in inputs.items():
        versions[key] = DataVersion(recorded) if recorded else DEFAULT_DATA_VERSION
        tags[get_input_data_version_tag(key)] = versions[key].value
        tags[get_input_event_pointer_tag(key)] = str(storage_id) if storage_id is not None else "NULL"
    tags[DATA_VERSION_TAG] = compute_logical_data_version(code_version, versions).value
    return tags


def stale_causes(defs: Definitions, instance: DagsterInstance, key: AssetKey, partition: str | None) -> list[str] | None:
    """None when the asset (partition) is not stale; else why, one line per root cause (may be empty)."""
    from dagster._core.asset_graph_view.asset_graph_view import AssetGraphView
    from dagster._core.definitions.temporal_context import TemporalContext
    from dagster._time import get_current_datetime

    graph = defs.resolve_asset_graph()
    view = AssetGraphView(temporal_context=TemporalContext(effective_dt=get_current_datetime(), last_event_id=None),
                          instance=instance, asset_graph=graph)
    resolver = CachingStaleStatusResolver(instance, graph, view)
    if resolver.get_status(key, partition) != StaleStatus.STALE:
        return None
    return sorted({_describe(c) for c in resolver.get_stale_root_causes(key, partition)})


def _describe(cause) -> str:
    where = cause.key.asset_key.to_user_string() + (f"[{cause.key.partition_key}]" if cause.key.partition_key else "")
    return f"{where} {cause.reason}"
