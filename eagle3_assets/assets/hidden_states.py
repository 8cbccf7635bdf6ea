"""`hidden_states[shard]`: the target's aux hidden states and its teacher signal, one file per sample, extracted
in the `launcher`'s process (torchrun for several) for a range of shards with one model load; the factory's
multi-shard mode keeps each shard its own partition, check, failure and retry. With `extraction.teacher: topk`
the files hold top-k log-probabilities over the draft vocabulary, so the asset depends on `vocab_map` too."""

from pathlib import Path

from dagster import AssetExecutionContext, MetadataValue

from ..checks import SHARD_CHECK_SPEC, shard_complete
from ..core.extract_job import ExtractShards, layout_version, shard_jobs
from ..core.layout import Layout
from ..launchers import GpuJob, Launcher
from ..partitions import shards
from ..policies import GPU_POOL, GPU_RETRY
from ..settings import Settings
from ..factory import StageSpec, launch_shards

CODE_VERSION = "1"
SETTINGS_USED = ("target_model", "extraction.aux_layer_ids", "extraction.dtype")


def code_version(settings: Settings) -> str:
    """The settings that shape the files, and their layout."""
    return f"{CODE_VERSION}-{settings.fingerprint(*SETTINGS_USED)}{layout_version(settings.extraction)}"


def extract(context: AssetExecutionContext, settings: Settings, paths: Layout, launcher: Launcher, keys: list[str],
            redo: bool) -> dict[str, dict]:
    """One job over `keys`, one model load: each shard's `{"metadata"}` or `{"error"}`."""
    jobs, results = shard_jobs(paths, keys, settings.target_model, settings.model_cache_dir, settings.extraction, redo)
    if jobs:
        results.update(launch_shards(context, launcher, GpuJob(
            "extract-hidden-states", "eagle3_assets.entrypoints.extract_hidden_states", ExtractShards(jobs),
            nproc=settings.extraction.nproc), [Path(j.shard_dir).name for j in jobs]))
    return {s: r if "error" in r else {"metadata": {**r["metadata"], "path": MetadataValue.path(r["metadata"]["path"]),
                                                    "aux_layer_ids": MetadataValue.json(r["metadata"]["aux_layer_ids"])}}
            for s, r in results.items()}


SPEC = StageSpec(
    name="hidden_states", group="features", kinds=("pytorch", "safetensors"), job="extraction_job", partitions=shards,
    deps=lambda settings: ["generations", "vocab_map"] if settings.extraction.teacher == "topk" else ["generations"],
    shard_deps=("generations",), pool=GPU_POOL, retry_policy=GPU_RETRY, launcher=True, code_version=code_version,
    run_shards=extract, check_shard=shard_complete, shard_check_spec=SHARD_CHECK_SPEC,
    description="Per-sample safetensors (input_ids, loss_mask, aux_hidden_states, and last_hidden_state or the "
                "top-k teacher; bf16 or fp8) + manifest.")
build = SPEC.build  # the asset for some settings
