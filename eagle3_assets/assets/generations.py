"""`generations[shard]`: the target's own answers, as token ids + loss mask, generated in the `launcher`'s
process (a pod on Kubernetes) for a range of shards with one model load; the factory's multi-shard mode keeps
each shard its own partition, failure and retry. A shard whose rows are unchanged is kept, not regenerated."""

from dagster import AssetExecutionContext, MetadataValue

from ..core.engines import GenerateShards, shard_job, shard_prompts, unchanged
from ..core.layout import Layout
from ..launchers import GpuJob, Launcher
from ..partitions import shards
from ..policies import FORCE_TAG, GPU_POOL, GPU_RETRY
from ..records import latest_metadata
from ..settings import Settings
from ..factory import StageSpec, launch_shards

CODE_VERSION = "1"
SETTINGS_USED = ("target_model", "generation")
SETTINGS_USED_ALL_TURNS = ("max_prompt_tokens",)  # the budget of every later turn's prompt


def code_version(settings: Settings) -> str:
    all_turns = settings.generation.turns == "all"
    return f"{CODE_VERSION}-{settings.fingerprint(*SETTINGS_USED, *(SETTINGS_USED_ALL_TURNS if all_turns else ()))}"


def generate(context: AssetExecutionContext, settings: Settings, paths: Layout, launcher: Launcher, keys: list[str],
             redo: bool) -> dict[str, dict]:
    """One job over the shards of `keys` to answer, one model load: each shard's `{"metadata"}` or `{"error"}`."""
    version, gen, jobs, results, ours = code_version(settings), settings.generation, [], {}, {}
    for shard in keys:
        try:
            rows, rows_sha256 = shard_prompts(paths.prompts, shard, all_turns=gen.turns == "all")
        except ValueError as e:  # the prompt table lacks the shard's rows: no retry helps
            results[shard] = {"error": str(e), "final": True}
            continue
        out = paths.generations(shard)
        ours[shard] = {"prompts": len(rows), "rows_sha256": rows_sha256, "code_version": version,
                       "path": MetadataValue.path(str(out))}
        previous = latest_metadata(context.instance, context.asset_key, shard)
        if unchanged(previous, rows_sha256, version, out) and FORCE_TAG not in context.run.tags:
            context.log.info(f"shard {shard}: its prompt rows are unchanged; keeping {out}")
            results[shard] = {"metadata": {"samples": previous["samples"], "tokens": previous["tokens"], "reused": True,
                                           **ours[shard]}}
        else:
            jobs.append(shard_job(paths.prompts, shard, out, settings.target_model, settings.model_cache_dir, gen,
                                  settings.max_prompt_tokens))
    done = launch_shards(context, launcher, GpuJob(  # one process; vLLM spreads a tensor-parallel target itself
        "generate-answers", "eagle3_assets.entrypoints.generate_answers", GenerateShards(jobs),
        gpus=gen.tensor_parallel_size if gen.engine == "vllm" else 1), [j.shard for j in jobs]) if jobs else {}
    return {**results, **{s: r if "error" in r else {"metadata": {**r["metadata"], "reused": False, **ours[s]}}
                          for s, r in done.items()}}


SPEC = StageSpec(
    name="generations", group="data", kinds=("pytorch", "parquet"), job="shard_job", deps=("prompts",), partitions=shards,
    pool=GPU_POOL, retry_policy=GPU_RETRY, launcher=True, code_version=code_version, run_shards=generate,
    description="The target's conversations per shard (Parquet: row_id, input_ids, loss_mask over its answers).")
build = SPEC.build  # the asset for some settings
