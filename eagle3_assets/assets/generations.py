"""`generations[shard]`: the target's own answers, as token ids + loss mask."""

import hashlib
import json

import polars as pl
from dagster import AssetExecutionContext, MaterializeResult, MetadataValue, asset

from ..core.engines import generate
from ..core.shards import shard_range
from ..core.target import resolve_target
from ..partitions import shards
from ..policies import FORCE_TAG, GPU_POOL, GPU_RETRY
from ..records import latest_metadata
from ..resources import layout
from ..settings import Settings

CODE_VERSION = "1"
JOB = "shard_job"  # the code location's job that materializes it (`eagle3 run`, the UI)
SETTINGS_USED = ("target_model", "generation")
SETTINGS_USED_ALL_TURNS = ("max_prompt_tokens",)  # the budget of every later turn's prompt


def build(settings: Settings):
    paths = layout(settings)
    all_turns = settings.generation.turns == "all"
    used = SETTINGS_USED + (SETTINGS_USED_ALL_TURNS if all_turns else ())
    code_version = f"{CODE_VERSION}-{settings.fingerprint(*used)}"

    @asset(
        name="generations",
        group_name="data",
        kinds={"pytorch", "parquet"},
        deps=["prompts"],
        partitions_def=shards,
        pool=GPU_POOL,
        retry_policy=GPU_RETRY,
        code_version=code_version,
        description="The target's conversations per shard (Parquet: row_id, input_ids, loss_mask over its answers).",
    )
    def generations(context: AssetExecutionContext) -> MaterializeResult:
        start, end = shard_range(context.partition_key)
        rows = pl.read_parquet(paths.prompts).filter(pl.col("row_id").is_between(start, end, closed="left"))
        if len(rows) != end - start:
            raise ValueError(
                f"shard {context.partition_key} expects rows {start}..{end - 1} but prompts has {len(rows)} of them; "
                "materialize `prompts` again"
            )
        out = paths.generations(context.partition_key)
        columns = ("row_id", "system", "prompt") + (("later_turns",) if all_turns else ())
        rows_sha256 = hashlib.sha256(json.dumps(rows.select(*columns).rows()).encode()).hexdigest()
        # The prompt table changed (e.g. prompts were appended) but not this shard's rows, and the
        # code and settings are the same: the answers on disk are the ones we would compute.
        previous = latest_metadata(context.instance, context.asset_key, context.partition_key)
        if (previous.get("rows_sha256") == rows_sha256 and previous.get("code_version") == code_version
                and out.is_file() and FORCE_TAG not in context.run.tags):
            context.log.info(f"shard {context.partition_key}: its prompt rows are unchanged; keeping {out}")
            return MaterializeResult(metadata={"samples": previous["samples"], "tokens": previous["tokens"],
                                               "reused": True, "rows_sha256": rows_sha256, "code_version": code_version,
                                               "path": MetadataValue.path(str(out))})
        model_dir = resolve_target(settings.target_model, settings.model_cache_dir)
        run = generate(settings.generation, model_dir, rows, out, max_prompt_tokens=settings.max_prompt_tokens,
                       log=context.log.info)
        result = run.result
        return MaterializeResult(
            metadata={
                "samples": result.samples,  # prompt rows x (1 + samples_per_prompt), less any with no answer
                "prompts": len(rows),
                **result.counts,  # turns asked; turns over the prompt budget; conversations cut by it
                "tokens": result.tokens,
                "prompt_tokens": result.prompt_tokens,
                "answer_tokens": result.answer_tokens,
                "tokens_per_s": round(result.tokens_per_s, 2),
                "generate_s": round(result.generate_s, 3),
                "model_load_s": round(run.model_load_s, 3),
                "engine": run.engine,
                "device": run.device,
                **run.extra_metadata,
                "reused": False,
                "rows_sha256": rows_sha256,
                "code_version": code_version,
                "path": MetadataValue.path(str(out)),
            }
        )

    return generations

