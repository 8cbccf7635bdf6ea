"""`drafter_eval`: acceptance length (tau) by real greedy speculative decoding on held-out prompts."""

import json

from dagster import AssetExecutionContext, MaterializeResult, MetadataValue, asset

from ..core.evaluate import EvalJob, evaluate
from ..core.files import atomic_write_text
from ..core.target import resolve_target
from ..policies import GPU_POOL
from ..resources import layout
from ..settings import Settings

CODE_VERSION = "2"
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
        job = EvalJob(str(resolve_target(settings.target_model, settings.model_cache_dir)), str(paths.drafter),
                      settings.eval)
        r = evaluate(job, log=context.log.info)
        atomic_write_text(json.dumps(r, indent=2), paths.drafter_eval)
        per_set = {f"tau_{name}": round(s["tau"], 4) for name, s in r["sets"].items()}
        optional = {k: round(r[k], 3) if isinstance(r[k], float) else r[k]
                    for k in ("speedup", "spec_s", "greedy_s", "speedup_prompts", "greedy_check_matches",
                              "greedy_check_prompts") if k in r}
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
                "workers": r["workers"],
                "dtype": r["dtype"],
                "acceptance_s": round(r["acceptance_s"], 2),
                "eval_s": round(r["eval_s"], 2),
                "path": MetadataValue.path(str(paths.drafter_eval)),
            }
        )

    return drafter_eval
