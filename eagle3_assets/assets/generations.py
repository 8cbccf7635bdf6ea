"""`generations[shard]`: the target's own answers, as token ids + loss mask.

The generation runs in its own process (a pod on Kubernetes), started by the `launcher` resource
through Dagster Pipes, like the other GPU stages; this asset checks the rows, skips a shard whose
rows are unchanged, and adds its own metadata to what the job reports."""

import hashlib
import json

import polars as pl
from dagster import AssetExecutionContext, MaterializeResult, MetadataValue, ResourceParam, asset

from ..core.engines import GenerateJob
from ..core.shards import shard_range
from ..core.target import resolve_target
from ..launchers import GpuJob, Launcher
from ..partitions import shards
from ..policies import FORCE_TAG, GPU_POOL, GPU_RETRY
from ..records import latest_metadata
from ..resources import layout
from ..settings import Settings

CODE_VERSION = "1"
JOB = "shard_job"  # the code location's job that materializes it (`eagle3 run`, the UI)
SETTINGS_USED = ("target_model", "generation")
SETTINGS_USED_ALL_TURNS = ("max_prompt_tokens",)  # the budget of every later turn's prompt
SHARD_LABEL = "eagle3.dev/shard"


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
    def generations(context: AssetExecutionContext, launcher: ResourceParam[Launcher]) -> MaterializeResult:
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
        job = GenerateJob(prompts_path=str(paths.prompts), row_start=start, row_end=end, out_path=str(out),
                          model_dir=str(model_dir), config=settings.generation,
                          max_prompt_tokens=settings.max_prompt_tokens)
        gen = settings.generation
        # one process; vLLM spreads a tensor-parallel target over the GPUs itself
        gpu_job = GpuJob("generate-answers", "eagle3_assets.entrypoints.generate_answers", job,
                         gpus=gen.tensor_parallel_size if gen.engine == "vllm" else 1,
                         labels={SHARD_LABEL: context.partition_key})
        m = launcher.run(context, gpu_job).get_materialize_result().metadata
        return MaterializeResult(
            metadata={
                "samples": m["samples"],
                "prompts": len(rows),
                **{k: v for k, v in m.items() if k != "samples"},
                "reused": False,
                "rows_sha256": rows_sha256,
                "code_version": code_version,
                "path": MetadataValue.path(str(out)),
            }
        )

    return generations

