"""`drafter`: the EAGLE-3 drafter trained with training-time test over all shards.

Training runs as its own process (torchrun: DDP over several GPUs), started by the `launcher`
resource through Dagster Pipes. Its state is kept under `drafter_state/` while it runs: a
killed or stopped training continues on the next materialization with the same settings.
"""

import contextlib
import json
import logging

from dagster import AssetExecutionContext, AssetObservation, Failure, MaterializeResult, MetadataValue, ResourceParam, asset
from safetensors import safe_open

from ..core.export import export_speculators, validate_for_engine, verifier_name, write_engine_checkpoint
from ..core.model_card import CARD_NAME
from ..core.report import settings_snapshot, snapshot_sha256
from ..core.sample_files import MANIFEST, shard_damage
from ..core.target import load_target_head, resolve_target
from ..core.train import TrainJob
from ..core.vocab import load_vocab_map
from ..entrypoints.train_drafter import CURVE_POINT
from ..launchers import GpuJob, Launcher
from ..partitions import shards
from ..policies import GPU_POOL, GPU_RETRY
from ..resources import layout
from ..settings import Settings

CODE_VERSION = "1"
JOB = "drafter_job"  # the code location's job that materializes it (`eagle3 run`, the UI)
SETTINGS_USED = ("target_model", "extraction.aux_layer_ids", "vocab", "training")


def build(settings: Settings):
    paths = layout(settings)

    @asset(
        name="drafter",
        group_name="drafter",
        kinds={"pytorch", "safetensors"},
        deps=["hidden_states", "vocab_map"],
        pool=GPU_POOL,
        retry_policy=GPU_RETRY,
        code_version=f"{CODE_VERSION}-{settings.fingerprint(*SETTINGS_USED)}",
        description="EAGLE-3 checkpoint (config.json + model.safetensors) that vLLM and SGLang load.",
    )
    def drafter(context: AssetExecutionContext, launcher: ResourceParam[Launcher]) -> MaterializeResult:
        keys = context.instance.get_dynamic_partitions(shards.name)
        incomplete = [k for k in keys if not (paths.hidden_states(k) / MANIFEST).is_file()]
        if not keys or incomplete:
            raise FileNotFoundError(f"drafter needs every shard's hidden states; incomplete: {incomplete or 'all (no shards)'}")
        damaged = {k: d for k in keys if (d := shard_damage(paths.hidden_states(k)))}
        if damaged:  # no retry helps: `eagle3 run` re-extracts the damaged files first
            raise Failure("hidden states damaged since they were extracted (`eagle3 run` re-extracts what is "
                          "missing or resized): " + " | ".join(f"{k}: {d}" for k, d in damaged.items()),
                          allow_retries=False)
        shard_dirs = [paths.hidden_states(k) for k in keys]
        model_dir = resolve_target(settings.target_model, settings.model_cache_dir)
        aux_ids = _aux_layer_ids(shard_dirs[0])
        job = TrainJob(
            shard_dirs=[str(d) for d in shard_dirs],
            target_model_dir=str(model_dir),
            vocab_map_path=str(paths.vocab_map),
            out_dir=str(paths.drafter),
            aux_layer_ids=aux_ids,
            draft_vocab_size=int(load_vocab_map(paths.vocab_map)[0].numel()),
            config=settings.training,
            state_path=str(paths.drafter_state),
        )
        for d in (paths.drafter, *paths.drafter_exports.values()):
            (d / CARD_NAME).unlink(missing_ok=True)  # drafter_eval writes the new drafter's card
        gpu_job = GpuJob("train-drafter", "eagle3_assets.entrypoints.train_drafter", job, nproc=settings.training.nproc)
        with observe_learning_curve(context):  # each point as training logs it: real timestamps, watchable live
            trained = launcher.run(context, gpu_job).get_materialize_result()

        # One copy per serving engine: each reads the layer ids from a different place and in a
        # different numbering (README, "Layer ids"); the validator checks each copy as its engine would.
        exports = {e: write_engine_checkpoint(paths.drafter, paths.drafter_export(e), e) for e in ("vllm", "sglang")}
        embed, _, _ = load_target_head(model_dir)
        # The verifier is what the drafter learned: a GGUF target's (the embedded one's) converted
        # folder, a user's folder by the path they gave; the architectures come from that folder.
        exports["speculators"] = export_speculators(
            paths.drafter, paths.drafter_export("speculators"), embed, verifier_name(settings.target_model, model_dir),
            speculative_tokens=settings.training.ttt_steps,
            verifier_architectures=_architectures(model_dir),
        )
        for engine, path in (("vllm", exports["vllm"]), ("sglang", exports["sglang"]), ("vllm", exports["speculators"])):
            problems = validate_for_engine(path, engine, extracted_layer_ids=aux_ids)
            if problems:
                raise ValueError(f"drafter export {path} would not load correctly in {engine}: {problems}")
        # the settings it was trained with, so drafter_eval and `eagle3 report` can say what changed
        snapshot = settings_snapshot(settings.model_dump(mode="json"))
        return MaterializeResult(
            metadata={**trained.metadata, **{f"export_{e}": MetadataValue.path(str(p)) for e, p in exports.items()},
                      "settings": MetadataValue.json(snapshot), "settings_sha256": snapshot_sha256(snapshot)}
        )

    return drafter


def curve_observation(asset_key, point: dict) -> AssetObservation:
    """One learning-curve point: loss and top-1 per TTT step as numbers (the UI plots them over
    the observations' times); its step and training time as text, which are not metrics."""
    return AssetObservation(asset_key=asset_key, description=f"step {point['step']}, {point['time_s']:.0f} s trained", metadata={
        "curve_step": MetadataValue.text(str(point["step"])),
        "curve_train_s": MetadataValue.text(f"{point['time_s']:.2f}"),
        "curve_loss": point["loss"],
        **{f"curve_top1_step_{k}": a for k, a in enumerate(point["accuracy"])},
    })


@contextlib.contextmanager
def observe_learning_curve(context: AssetExecutionContext):
    """While the training job runs, turn each learning-curve point it sends (a Pipes log line,
    `entrypoints/train_drafter.py` CURVE_POINT) into an observation of the asset, as it arrives."""

    class Points(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            message = record.getMessage()
            if not message.startswith(CURVE_POINT):
                return True
            context.log_event(curve_observation(context.asset_key, json.loads(message[len(CURVE_POINT):])))
            return False  # an observation, not a log line

    points = Points()
    context.log.addFilter(points)
    try:
        yield
    finally:
        context.log.removeFilter(points)


def _aux_layer_ids(shard_dir) -> list[int]:
    """The layer ids the shard was extracted with, from a sample file's metadata."""
    first = next(shard_dir.glob("*.safetensors"))
    with safe_open(str(first), framework="pt") as f:
        return [int(x) for x in f.metadata()["aux_layer_ids"].split(",")]


def _architectures(model_dir) -> list[str]:
    return list(json.loads((model_dir / "config.json").read_text()).get("architectures") or [])
