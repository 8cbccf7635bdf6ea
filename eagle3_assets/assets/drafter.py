"""`drafter`: the EAGLE-3 drafter trained with training-time test over all shards, in its own process
(torchrun: DDP over several GPUs) started by the `launcher` resource. Its state is kept under `drafter_state/`
until the asset has its result: a killed or stopped training continues on the next materialization with
the same settings, and one that finished but was stopped before its result finishes at once."""

from dagster import AssetExecutionContext, Failure, MaterializeResult, MetadataValue

from ..core.export import export_for_engines, shard_aux_layer_ids
from ..core.layout import Layout
from ..core.model_card import CARD_NAME
from ..core.report import settings_snapshot, snapshot_sha256
from ..core.sample_files import MANIFEST, shard_damage
from ..core.target import resolve_target
from ..core.train import TrainJob, finish_state
from ..core.vocab import load_vocab_map
from ..launchers import GpuJob, Launcher
from ..observe import observe_learning_curve
from ..partitions import shards
from ..policies import GPU_POOL, GPU_RETRY
from ..settings import Settings
from ..factory import StageSpec, versioned

CODE_VERSION = "1"
SETTINGS_USED = ("target_model", "extraction.aux_layer_ids", "vocab", "training")


def materialize(context: AssetExecutionContext, settings: Settings, paths: Layout, launcher: Launcher):
    keys = context.instance.get_dynamic_partitions(shards.name)
    incomplete = [k for k in keys if not (paths.hidden_states(k) / MANIFEST).is_file()]
    if not keys or incomplete:
        raise FileNotFoundError(f"drafter needs every shard's hidden states; incomplete: {incomplete or 'all (no shards)'}")
    damaged = {k: d for k in keys if (d := shard_damage(paths.hidden_states(k)))}
    if damaged:  # no retry helps: `eagle3 run` re-extracts the damaged files first
        raise Failure("hidden states damaged since they were extracted (`eagle3 run` re-extracts what is "
                      "missing or resized): " + " | ".join(f"{k}: {d}" for k, d in damaged.items()), allow_retries=False)
    model_dir = resolve_target(settings.target_model, settings.model_cache_dir)
    aux_ids = shard_aux_layer_ids(paths.hidden_states(keys[0]))
    job = TrainJob(shard_dirs=[str(paths.hidden_states(k)) for k in keys], target_model_dir=str(model_dir),
                   vocab_map_path=str(paths.vocab_map), out_dir=str(paths.drafter), aux_layer_ids=aux_ids,
                   draft_vocab_size=int(load_vocab_map(paths.vocab_map)[0].numel()), config=settings.training,
                   state_path=str(paths.drafter_state))
    for d in (paths.drafter, *paths.drafter_exports.values()):
        (d / CARD_NAME).unlink(missing_ok=True)  # drafter_eval writes the new drafter's card
    gpu_job = GpuJob("train-drafter", "eagle3_assets.entrypoints.train_drafter", job, nproc=settings.training.nproc)
    with observe_learning_curve(context):  # each point as training logs it: real timestamps, watchable live
        trained = launcher.run(context, gpu_job).get_materialize_result()
    exports = export_for_engines(paths.drafter, paths.drafter_exports, model_dir, settings.target_model, settings.training.ttt_steps, aux_ids)
    snapshot = settings_snapshot(settings.model_dump(mode="json"))  # so drafter_eval and `eagle3 report` say what changed
    finish_state(job.state_path)  # the last step before the result: the next materialization trains afresh
    return MaterializeResult(metadata={**trained.metadata, **{f"export_{e}": MetadataValue.path(str(p)) for e, p in exports.items()},
                                       "settings": MetadataValue.json(snapshot), "settings_sha256": snapshot_sha256(snapshot)})


SPEC = StageSpec(
    name="drafter", group="drafter", kinds=("pytorch", "safetensors"), job="drafter_job", deps=("hidden_states", "vocab_map"),
    pool=GPU_POOL, retry_policy=GPU_RETRY, launcher=True, code_version=versioned(CODE_VERSION, *SETTINGS_USED),
    materialize=materialize,
    description="EAGLE-3 checkpoint (config.json + model.safetensors) that vLLM and SGLang load.",
)

build = SPEC.build  # the asset for some settings
