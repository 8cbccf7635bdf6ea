"""`generations[shard]`: the target's own answers, as token ids + loss mask, generated in the `launcher`'s
process (a pod on Kubernetes); this asset checks the rows, skips a shard whose rows are unchanged, and adds
its own metadata to what the job reports."""

from dagster import AssetExecutionContext, MaterializeResult, MetadataValue

from ..core.engines import GenerateJob, shard_prompts
from ..core.layout import Layout
from ..core.shards import shard_range
from ..core.target import resolve_target
from ..launchers import GpuJob, Launcher
from ..partitions import shards
from ..policies import FORCE_TAG, GPU_POOL, GPU_RETRY
from ..records import latest_metadata
from ..settings import Settings
from ..factory import StageSpec

CODE_VERSION = "1"
SETTINGS_USED = ("target_model", "generation")
SETTINGS_USED_ALL_TURNS = ("max_prompt_tokens",)  # the budget of every later turn's prompt
SHARD_LABEL = "eagle3.dev/shard"


def code_version(settings: Settings) -> str:
    all_turns = settings.generation.turns == "all"
    return f"{CODE_VERSION}-{settings.fingerprint(*SETTINGS_USED, *(SETTINGS_USED_ALL_TURNS if all_turns else ()))}"


def materialize(context: AssetExecutionContext, settings: Settings, paths: Layout, launcher: Launcher):
    shard, version, gen = context.partition_key, code_version(settings), settings.generation
    rows, rows_sha256 = shard_prompts(paths.prompts, shard, all_turns=gen.turns == "all")
    out = paths.generations(shard)
    ours = {"rows_sha256": rows_sha256, "code_version": version, "path": MetadataValue.path(str(out))}
    # The prompt table changed (e.g. prompts were appended) but not this shard's rows, and the
    # code and settings are the same: the answers on disk are the ones we would compute.
    previous = latest_metadata(context.instance, context.asset_key, shard)
    if (previous.get("rows_sha256") == rows_sha256 and previous.get("code_version") == version
            and out.is_file() and FORCE_TAG not in context.run.tags):
        context.log.info(f"shard {shard}: its prompt rows are unchanged; keeping {out}")
        return MaterializeResult(metadata={"samples": previous["samples"], "tokens": previous["tokens"], "reused": True, **ours})
    start, end = shard_range(shard)
    job = GenerateJob(prompts_path=str(paths.prompts), row_start=start, row_end=end, out_path=str(out), config=gen,
                      model_dir=str(resolve_target(settings.target_model, settings.model_cache_dir)),
                      max_prompt_tokens=settings.max_prompt_tokens)
    # one process; vLLM spreads a tensor-parallel target over the GPUs itself
    gpu_job = GpuJob("generate-answers", "eagle3_assets.entrypoints.generate_answers", job, labels={SHARD_LABEL: shard},
                     gpus=gen.tensor_parallel_size if gen.engine == "vllm" else 1)
    m = launcher.run(context, gpu_job).get_materialize_result().metadata
    return MaterializeResult(metadata={"samples": m["samples"], "prompts": len(rows),
                                       **{k: v for k, v in m.items() if k != "samples"}, "reused": False, **ours})


SPEC = StageSpec(
    name="generations", group="data", kinds=("pytorch", "parquet"), job="shard_job", deps=("prompts",), partitions=shards,
    pool=GPU_POOL, retry_policy=GPU_RETRY, launcher=True, code_version=code_version, materialize=materialize,
    description="The target's conversations per shard (Parquet: row_id, input_ids, loss_mask over its answers).")
build = SPEC.build  # the asset for some settings
