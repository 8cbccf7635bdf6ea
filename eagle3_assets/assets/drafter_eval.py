"""`drafter_eval`: acceptance length (tau) by real greedy speculative decoding on held-out prompts, in the
`launcher`'s process (a pod on Kubernetes); then the drafter's model card, from what the run recorded."""

import json
from dataclasses import asdict
from functools import partial

from dagster import AssetExecutionContext, MaterializeResult, MetadataValue

from ..core.evaluate import EvalJob
from ..core.export import verifier_name
from ..core.files import atomic_write_text
from ..core.layout import Layout
from ..core.model_card import CARD_NAME, model_card
from ..core.report import comparison_markdown, drafter_record, drafter_rows, eval_summary, manifests_summary, settings_snapshot
from ..core.target import describe_target, resolve_target
from ..launchers import GpuJob, Launcher
from ..partitions import shards
from ..policies import GPU_POOL
from ..records import latest_metadata, plain_records
from ..settings import Settings
from ..factory import StageSpec, versioned

CODE_VERSION = "3"
SETTINGS_USED = ("target_model", "eval")
# the metadata that is not a plain number or text, by how the UI shows it
SHOWN_AS = {"path": MetadataValue.path, "model_card": MetadataValue.md, "model_card_path": MetadataValue.path, **dict.fromkeys(
    ("per_position_acceptance", "tau_by_category", "prompt_sets", "speedup_batches", "settings", "sources"), MetadataValue.json)}


def materialize(context: AssetExecutionContext, settings: Settings, paths: Layout, launcher: Launcher):
    model_dir = resolve_target(settings.target_model, settings.model_cache_dir)
    job = EvalJob(str(model_dir), str(paths.drafter), settings.eval, result_path=str(paths.drafter_eval))
    paths.drafter_eval.unlink(missing_ok=True)  # what is read back below is this job's result, never an older one
    gpu_job = GpuJob("evaluate-drafter", "eagle3_assets.entrypoints.evaluate_drafter", job, gpus=1)
    device = launcher.run(context, gpu_job).get_materialize_result().metadata["device"].value
    r = json.loads(paths.drafter_eval.read_text())  # written by the job
    keys = set(context.instance.get_dynamic_partitions(shards.name))
    shards_now = [s for s in manifests_summary(paths.root / "hidden_states") if s[0] in keys]
    latest = partial(latest_metadata, context.instance)  # an asset's (partition's) latest metadata
    card = model_card(verifier_name(settings.target_model, model_dir), latest("prompts"), shards_now,
                      asdict(settings.generation), latest("drafter"), r, paths.drafter_exports, settings.eval.num_draft_tokens,
                      target=describe_target(settings.target_model, model_dir))
    for d in (paths.drafter, *paths.drafter_exports.values()):  # the card beside the drafter and each export
        atomic_write_text(card, d / CARD_NAME)
    record = drafter_record(settings_snapshot(settings.model_dump(mode="json")), latest("drafter"), latest("prompts"),
                            shards_now, [(latest("generations", k), latest("hidden_states", k)) for k in sorted(keys)])
    plain = eval_summary(r, settings.eval.num_draft_tokens, device, card, record, paths)
    # every drafter so far, this one last, compared (markdown: the UI shows it; `eagle3 report` prints it)
    comparison = comparison_markdown(drafter_rows(plain_records(context.instance, "drafter_eval", context.run_id, plain)))
    return MaterializeResult(metadata={**{k: SHOWN_AS[k](v) if k in SHOWN_AS else v for k, v in plain.items()},
                                       "comparison": MetadataValue.md(comparison)})


SPEC = StageSpec(
    name="drafter_eval", group="drafter", kinds=("pytorch", "json"), job="drafter_job", deps=("drafter",), pool=GPU_POOL,
    launcher=True, code_version=versioned(CODE_VERSION, *SETTINGS_USED), materialize=materialize,
    description="Acceptance length tau of the drafter: the target verifies chains of drafted tokens.")
build = SPEC.build  # the asset for some settings
