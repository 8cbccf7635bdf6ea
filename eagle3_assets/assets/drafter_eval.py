"""`drafter_eval`: acceptance length (tau) by real greedy speculative decoding on held-out prompts;
then the drafter's model card (README.md beside the drafter and each export), from what the run
recorded."""

import json
from dataclasses import asdict

from dagster import AssetExecutionContext, AssetKey, MaterializeResult, MetadataValue, asset

from ..core.evaluate import EvalJob, evaluate
from ..core.export import verifier_name
from ..core.files import atomic_write_text
from ..core.model_card import CARD_NAME, model_card
from ..core.report import manifests_summary
from ..core.target import describe_target, pick_device, resolve_target
from ..partitions import shards
from ..policies import GPU_POOL
from ..resources import layout
from ..settings import Settings

CODE_VERSION = "3"
SETTINGS_USED = ("target_model", "eval")


def build(settings: Settings):
    paths = layout(settings)

    @asset(
        name="drafter_eval",
        group_name="drafter",
        kinds={"pytorch", "json"},
        deps=["drafter"],
        pool=GPU_POOL,
        code_version=f"{CODE_VERSION}-{settings.fingerprint(*SETTINGS_USED)}",
        description="Acceptance length tau of the drafter: the target verifies chains of drafted tokens.",
    )
    def drafter_eval(context: AssetExecutionContext) -> MaterializeResult:
        model_dir = resolve_target(settings.target_model, settings.model_cache_dir)
        job = EvalJob(str(model_dir), str(paths.drafter), settings.eval)
        r = evaluate(job, log=context.log.info)
        atomic_write_text(json.dumps(r, indent=2), paths.drafter_eval)
        exports = paths.drafter_exports
        keys = set(context.instance.get_dynamic_partitions(shards.name))
        card = model_card(
            verifier_name(settings.target_model, model_dir), _latest_metadata(context, "prompts"),
            [s for s in manifests_summary(paths.root / "hidden_states") if s[0] in keys], asdict(settings.generation),
            _latest_metadata(context, "drafter"), r, exports, settings.eval.num_draft_tokens,
            target=describe_target(settings.target_model, model_dir),
        )
        for d in (paths.drafter, *exports.values()):
            atomic_write_text(card, d / CARD_NAME)
        per_set = {f"tau_{name}": round(s["tau"], 4) for name, s in r["sets"].items()}
        speed = [f"{k}_b{b}" for b in r.get("speedup_batches", [])
                 for k in ("speedup", "greedy_tok_s", "spec_tok_s", "speedup_prompts")]
        optional = {k: round(r[k], 3) if isinstance(r[k], float) else r[k]
                    for k in (*speed, "greedy_check_matches", "greedy_check_prompts") if k in r}
        return MaterializeResult(
            metadata={
                "tau": round(r["tau"], 4),
                **per_set,
                **{f"acceptance_pos_{i}": round(a, 4) for i, a in enumerate(r["per_position_acceptance"])},
                "per_position_acceptance": MetadataValue.json([round(a, 4) for a in r["per_position_acceptance"]]),
                "tau_by_category": MetadataValue.json(
                    {name: {c: round(t, 4) for c, t in s["tau_by_category"].items()} for name, s in r["sets"].items()}),
                "prompts_used": r["prompts_used"],
                "new_tokens": r["new_tokens"],
                "verify_steps": r["verify_steps"],
                **optional,
                "num_draft_tokens": settings.eval.num_draft_tokens,
                "prompt_sets": MetadataValue.json(list(r["sets"])),
                "speedup_batches": MetadataValue.json(r.get("speedup_batches", [])),
                "engine": r["engine"],
                "batch_size": r["batch_size"],
                "workers": r["workers"],
                "dtype": r["dtype"],
                "device": pick_device(settings.eval.device).type,  # `eagle3 plan` times a run from the same kind
                **{k: round(r[k], 2) for k in ("load_s", "acceptance_s", "speedup_s", "check_s", "eval_s")},
                "path": MetadataValue.path(str(paths.drafter_eval)),
                "model_card": MetadataValue.md(card),
                "model_card_path": MetadataValue.path(str(paths.drafter / CARD_NAME)),
            }
        )

    return drafter_eval


def _latest_metadata(context: AssetExecutionContext, key: str) -> dict:
    event = context.instance.get_latest_materialization_event(AssetKey(key))
    meta = event.asset_materialization.metadata if event and event.asset_materialization else {}
    return {k: getattr(v, "value", v) for k, v in meta.items()}
