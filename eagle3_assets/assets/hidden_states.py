"""`hidden_states[shard]`: the target's aux and last hidden states, one file per sample.

The work runs in its own process (torchrun for several), launched through Dagster
Pipes; rank 0 streams progress to the run log and reports the shard's metadata.
"""

import json
from dataclasses import asdict

from dagster import AssetExecutionContext, MaterializeResult, asset

from ..core.extract_job import ExtractParams
from ..core.target import resolve_target
from ..launchers import launch_spec, pipes_client_for
from ..resources import GPU_POOL, GPU_RETRY, layout, shards
from ..settings import Settings

CODE_VERSION = "1"
SETTINGS_USED = ("target_model", "extraction.aux_layer_ids", "extraction.dtype")


def build(settings: Settings):
    paths = layout(settings)
    ex = settings.extraction

    @asset(
        name="hidden_states",
        deps=["generations"],
        partitions_def=shards,
        pool=GPU_POOL,
        retry_policy=GPU_RETRY,
        code_version=f"{CODE_VERSION}-{settings.fingerprint(*SETTINGS_USED)}",
        description="Per-sample safetensors (input_ids, loss_mask, aux_hidden_states, last_hidden_state) + manifest.",
    )
    def hidden_states(context: AssetExecutionContext) -> MaterializeResult:
        shard = context.partition_key
        generations = paths.generations(shard)
        if not generations.is_file():
            raise FileNotFoundError(f"no generations for shard {shard} at {generations}; materialize generations[{shard}] first")
        params = ExtractParams(
            generations_path=str(generations),
            shard_dir=str(paths.hidden_states(shard)),
            model_dir=str(resolve_target(settings.target_model, settings.model_cache_dir)),
            target_name=settings.target_model,
            aux_layer_ids=ex.aux_layer_ids,
            dtype=ex.dtype,
            device=ex.device,
            batch_tokens=ex.batch_tokens,
            writer_threads=ex.writer_threads,
            parallel=ex.parallel,
        )
        # Local subprocess / torchrun by default; one pod per shard with launcher.kind: kubernetes.
        return pipes_client_for(settings).run(
            context=context, **launch_spec(settings, shard, json.dumps(asdict(params)))
        ).get_materialize_result()

    return hidden_states
