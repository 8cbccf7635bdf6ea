"""`generations[shard]`: the target's own answers, as token ids + loss mask."""

import polars as pl
from dagster import AssetExecutionContext, MaterializeResult, MetadataValue, asset

from ..core.engines import generate
from ..core.shards import shard_range
from ..core.target import resolve_target
from ..resources import GPU_POOL, GPU_RETRY, layout, shards
from ..settings import Settings

CODE_VERSION = "1"
SETTINGS_USED = ("target_model", "generation")


def build(settings: Settings):
    paths = layout(settings)
    gen = settings.generation

    @asset(
        name="generations",
        deps=["prompts"],
        partitions_def=shards,
        pool=GPU_POOL,
        retry_policy=GPU_RETRY,
        code_version=f"{CODE_VERSION}-{settings.fingerprint(*SETTINGS_USED)}",
        description="The target's answers per shard (Parquet: row_id, input_ids, loss_mask).",
    )
    def generations(context: AssetExecutionContext) -> MaterializeResult:
        start, end = shard_range(context.partition_key)
        rows = pl.read_parquet(paths.prompts).filter(pl.col("row_id").is_between(start, end, closed="left"))
        if len(rows) != end - start:
            raise ValueError(
                f"shard {context.partition_key} expects rows {start}..{end - 1} but prompts has {len(rows)} of them; "
                "materialize `prompts` again"
            )
        model_dir = resolve_target(settings.target_model, settings.model_cache_dir)
        out = paths.generations(context.partition_key)
        run = generate(gen, model_dir, rows, out, log=context.log.info)
        result = run.result
        return MaterializeResult(
            metadata={
                "samples": result.samples,
                "tokens": result.tokens,
                "prompt_tokens": result.prompt_tokens,
                "answer_tokens": result.answer_tokens,
                "tokens_per_s": round(result.tokens_per_s, 2),
                "generate_s": round(result.generate_s, 3),
                "model_load_s": round(run.model_load_s, 3),
                "engine": run.engine,
                "device": run.device,
                "path": MetadataValue.path(str(out)),
            }
        )

    return generations
