"""`prompts`: normalize the prompt file and register the shard partitions."""

import hashlib

from dagster import AssetExecutionContext, DataVersion, MaterializeResult, MetadataValue, asset

from ..core.files import atomic_write_parquet
from ..core.generate import template_ids
from ..core.prompts import file_sha256, read_prompts, resolve_source
from ..core.shards import shard_keys
from ..core.target import load_tokenizer, resolve_target
from ..partitions import shards
from ..resources import layout
from ..settings import Settings

CODE_VERSION = "1"
SETTINGS_USED = ("target_model", "prompts_source", "max_prompts", "max_prompt_tokens", "shard_size")


def data_version(settings: Settings, source_sha256: str | None = None) -> str:
    """The prompt file's content and the settings that shape the table: equal versions, equal rows.
    `eagle3 run` compares it with the last materialization's to know whether the file changed."""
    sha = source_sha256 or file_sha256(resolve_source(settings.prompts_source))
    return hashlib.sha256(f"{sha}:{settings.fingerprint(*SETTINGS_USED)}".encode()).hexdigest()[:16]


def build(settings: Settings):
    paths = layout(settings)

    @asset(
        name="prompts",
        group_name="data",
        kinds={"parquet"},
        code_version=f"{CODE_VERSION}-{settings.fingerprint(*SETTINGS_USED)}",
        description="Normalized prompts (Parquet, row ids 0..N-1); registers the shard partitions.",
    )
    def prompts(context: AssetExecutionContext) -> MaterializeResult:
        tok = load_tokenizer(resolve_target(settings.target_model, settings.model_cache_dir))

        def too_long(system, prompt):
            return len(template_ids(tok, system, prompt)) > settings.max_prompt_tokens

        table = read_prompts(settings.prompts_source, settings.max_prompts, too_long)
        atomic_write_parquet(table.rows, paths.prompts)

        keys = shard_keys(len(table.rows), settings.shard_size)
        instance = context.instance
        existing = set(instance.get_dynamic_partitions(shards.name))
        stale = sorted(existing - set(keys))
        for key in stale:  # shards of an earlier prompt set that no longer exist
            instance.delete_dynamic_partition(shards.name, key)
        instance.add_dynamic_partitions(shards.name, [k for k in keys if k not in existing])
        context.log.info(f"{len(table.rows)} prompts in {len(keys)} shards; removed stale shards {stale}")

        dropped = {f"dropped_{reason}": n for reason, n in sorted(table.dropped.items())}
        return MaterializeResult(
            metadata={
                "rows": len(table.rows),
                "dropped": sum(table.dropped.values()),
                **dropped,
                "shards": len(keys),
                "shard_keys": MetadataValue.json(keys),
                "source": MetadataValue.path(table.source),
                "sha256": table.sha256,
                "path": MetadataValue.path(str(paths.prompts)),
            },
            data_version=DataVersion(data_version(settings, table.sha256)),
        )

    return prompts
