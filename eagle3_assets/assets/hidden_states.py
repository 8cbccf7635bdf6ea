"""`hidden_states[shard]`: the target's aux and last hidden states, one file per sample.

The work runs in its own process (torchrun for several), started by the `launcher` resource
through Dagster Pipes; rank 0 streams progress to the run log and reports the shard's metadata.
"""

from dagster import AssetExecutionContext, MaterializeResult, ResourceParam, asset

from ..core.extract_job import ExtractJob
from ..core.target import resolve_target
from ..launchers import GpuJob, Launcher
from ..partitions import shards
from ..policies import GPU_POOL, GPU_RETRY
from ..resources import layout
from ..settings import Settings

CODE_VERSION = "1"
SETTINGS_USED = ("target_model", "extraction.aux_layer_ids", "extraction.dtype")
SHARD_LABEL = "eagle3.dev/shard"


def build(settings: Settings):
    paths = layout(settings)

    @asset(
        name="hidden_states",
        group_name="features",
        kinds={"pytorch", "safetensors"},
        deps=["generations"],
        partitions_def=shards,
        pool=GPU_POOL,
        retry_policy=GPU_RETRY,
        code_version=f"{CODE_VERSION}-{settings.fingerprint(*SETTINGS_USED)}",
        description="Per-sample safetensors (input_ids, loss_mask, aux_hidden_states, last_hidden_state) + manifest.",
    )
    def hidden_states(context: AssetExecutionContext, launcher: ResourceParam[Launcher]) -> MaterializeResult:
        shard = context.partition_key
        generations = paths.generations(shard)
        if not generations.is_file():
            raise FileNotFoundError(f"no generations for shard {shard} at {generations}; materialize generations[{shard}] first")
        job = ExtractJob(
            generations_path=str(generations),
            shard_dir=str(paths.hidden_states(shard)),
            model_dir=str(resolve_target(settings.target_model, settings.model_cache_dir)),
            target_name=settings.target_model,
            config=settings.extraction,
        )
        gpu_job = GpuJob("extract-hidden-states", "eagle3_assets.jobs.extract_hidden_states", job,
                         nproc=settings.extraction.nproc, labels={SHARD_LABEL: shard})
        return launcher.run(context, gpu_job).get_materialize_result()

    return hidden_states
