"""`prompts`: normalize the prompt sources, drop what overlaps the evaluation sets, register the shard partitions.
The table and its version are `prompt_table`'s; this asset writes it and reports it."""

from dagster import AssetExecutionContext, DataVersion, MaterializeResult, MetadataValue

from ..core.files import atomic_write_parquet
from ..core.layout import Layout
from ..core.shards import shard_keys
from ..partitions import shards
from ..prompt_table import build_table, data_version, self_writer, settings_used, source_key
from ..settings import Settings
from ..factory import StageSpec

CODE_VERSION = "2"  # 2: later turns, source column, mixtures, decontamination


def materialize(context: AssetExecutionContext, settings: Settings, paths: Layout) -> MaterializeResult:
    writer = self_writer(settings, log=context.log.info)
    try:
        table, _ = build_table(settings, log=context.log.info, self_writer=writer)
    finally:
        if writer is not None:
            writer.close()
    atomic_write_parquet(table.rows, paths.prompts)
    keys = shard_keys(len(table.rows), settings.shard_size)
    instance = context.instance
    existing = set(instance.get_dynamic_partitions(shards.name))
    stale = sorted(existing - set(keys))
    for key in stale:  # shards of an earlier prompt set that no longer exist
        instance.delete_dynamic_partition(shards.name, key)
    instance.add_dynamic_partitions(shards.name, [k for k in keys if k not in existing])
    context.log.info(f"{len(table.rows)} prompts in {len(keys)} shards; removed stale shards {stale}")
    counts = ({"contaminated": 0} if settings.decontaminate else {}) | table.dropped  # 0 says it was checked
    turns = table.rows["later_turns"].list.len()
    return MaterializeResult(metadata={
        "rows": len(table.rows), "dropped": sum(table.dropped.values()),
        **{f"dropped_{reason}": n for reason, n in sorted(counts.items())},
        "shards": len(keys), "shard_keys": MetadataValue.json(keys), "source": MetadataValue.path(table.source),
        # per source: rows, licence, cap, drops; and the licences on their own to read at a glance
        "sources": MetadataValue.json(table.sources),
        "licences": MetadataValue.md("\n".join(f"- `{r['source']}`: {r['rows']} rows, {r['licence']}" for r in table.sources)),
        **{f"rows_{source_key(r['source'])}": r["rows"] for r in table.sources if len(table.sources) > 1},
        "conversations_with_later_turns": int((turns > 0).sum()), "later_turns": int(turns.sum()),
        **({"self_written_requests": writer.requests} if writer is not None else {}),
        "sha256": table.sha256, "path": MetadataValue.path(str(paths.prompts)),
    }, data_version=DataVersion(data_version(settings, table.sha256)))


SPEC = StageSpec(
    name="prompts", group="data", kinds=("parquet",), job="prompts_job", materialize=materialize,
    code_version=lambda settings: f"{CODE_VERSION}-{settings.fingerprint(*settings_used(settings))}",
    description="Normalized prompts (Parquet, row ids 0..N-1); registers the shard partitions.")
build = SPEC.build  # the asset for some settings
