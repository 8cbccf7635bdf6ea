"""`hidden_states[shard]`: the target's aux hidden states and its teacher signal, one file per sample.

The work runs in its own process (torchrun for several), started by the `launcher` resource
through Dagster Pipes; rank 0 streams progress to the run log and reports the shard's metadata.
With `extraction.teacher: topk` the files hold top-k log-probabilities over the draft
vocabulary, so the asset depends on `vocab_map` too (the lineage shows it).
"""

from dagster import AssetExecutionContext, MaterializeResult, ResourceParam, asset

from ..core.extract_job import ExtractJob, extract_layout
from ..core.sample_files import SampleLayout
from ..core.target import resolve_target
from ..core.vocab import load_vocab_map, vocab_map_fingerprint
from ..launchers import GpuJob, Launcher
from ..partitions import shards
from ..policies import GPU_POOL, GPU_RETRY
from ..resources import layout
from ..settings import Settings

CODE_VERSION = "1"
SETTINGS_USED = ("target_model", "extraction.aux_layer_ids", "extraction.dtype")
SHARD_LABEL = "eagle3.dev/shard"


def code_version(settings: Settings) -> str:
    """The settings that shape the files. The layout is named only when it is not the default
    bf16/last_hidden, so files made before the layouts existed stay fresh."""
    x = settings.extraction
    named = (x.storage, x.teacher) != ("bf16", "last_hidden")
    layout_part = f"-{x.storage}-{x.teacher}" + (str(x.topk) if x.teacher == "topk" else "") if named else ""
    return f"{CODE_VERSION}-{settings.fingerprint(*SETTINGS_USED)}{layout_part}"


def sample_layout(settings: Settings, hidden_size: int) -> SampleLayout:
    """The layout these settings write; with topk, over the vocab map on disk (when there is one)."""
    paths = layout(settings)
    draft_vocab = None
    if settings.extraction.teacher == "topk" and paths.vocab_map.is_file():
        draft_vocab = vocab_map_fingerprint(load_vocab_map(paths.vocab_map)[0])
    return extract_layout(settings.extraction, hidden_size, draft_vocab)


def build(settings: Settings):
    paths = layout(settings)
    topk = settings.extraction.teacher == "topk"

    @asset(
        name="hidden_states",
        group_name="features",
        kinds={"pytorch", "safetensors"},
        deps=["generations", "vocab_map"] if topk else ["generations"],
        partitions_def=shards,
        pool=GPU_POOL,
        retry_policy=GPU_RETRY,
        code_version=code_version(settings),
        description="Per-sample safetensors (input_ids, loss_mask, aux_hidden_states, and last_hidden_state or the "
                    "top-k teacher; bf16 or fp8) + manifest.",
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
            vocab_map_path=str(paths.vocab_map) if topk else None,
        )
        gpu_job = GpuJob("extract-hidden-states", "eagle3_assets.jobs.extract_hidden_states", job,
                         nproc=settings.extraction.nproc, labels={SHARD_LABEL: shard})
        return launcher.run(context, gpu_job).get_materialize_result()

    return hidden_states
