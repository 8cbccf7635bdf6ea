"""`drafter_eval`: acceptance length (tau) by real greedy speculative decoding on held-out prompts."""

import json

from dagster import AssetExecutionContext, MaterializeResult, MetadataValue, asset

from ..core.drafter import load_checkpoint
from ..core.evaluate import load_mtbench_first_turns, measure_acceptance
from ..core.files import atomic_write_text
from ..core.target import load_model, load_tokenizer, resolve_target
from ..resources import layout
from ..settings import Settings

CODE_VERSION = "1"
SETTINGS_USED = ("target_model", "eval")


def build(settings: Settings):
    paths = layout(settings)
    ev = settings.eval

    @asset(
        name="drafter_eval",
        deps=["drafter"],
        code_version=f"{CODE_VERSION}-{settings.fingerprint(*SETTINGS_USED)}",
        description="Acceptance length tau of the drafter: the target verifies chains of drafted tokens.",
    )
    def drafter_eval(context: AssetExecutionContext) -> MaterializeResult:
        model_dir = resolve_target(settings.target_model, settings.model_cache_dir)
        target = load_model(model_dir, "float32", ev.device)
        tok = load_tokenizer(model_dir)
        drafter = load_checkpoint(paths.drafter, target.get_input_embeddings().weight.detach()).to(target.device)
        prompts = load_mtbench_first_turns()[: ev.num_prompts]
        r = measure_acceptance(
            target, tok, drafter, prompts, ev.max_new_tokens, ev.num_draft_tokens, drafter.config.aux_layer_ids
        )
        atomic_write_text(json.dumps(r, indent=2), paths.drafter_eval)
        context.log.info(f"tau {r['tau']:.3f} over {r['verify_steps']} verification steps, speed-up {r['speedup']:.2f}x")
        return MaterializeResult(
            metadata={
                "tau": round(r["tau"], 4),
                **{f"acceptance_pos_{i}": round(a, 4) for i, a in enumerate(r["per_position_acceptance"])},
                "per_position_acceptance": MetadataValue.json([round(a, 4) for a in r["per_position_acceptance"]]),
                "prompts_used": r["prompts_used"],
                "new_tokens": r["new_tokens"],
                "verify_steps": r["verify_steps"],
                "speedup": round(r["speedup"], 3),
                "spec_s": round(r["spec_s"], 3),
                "greedy_s": round(r["greedy_s"], 3),
                "matches_greedy": r["matches_greedy"],
                "num_draft_tokens": ev.num_draft_tokens,
                "prompt_set": "MT-bench first turns (flexeval)",
                "path": MetadataValue.path(str(paths.drafter_eval)),
            }
        )

    return drafter_eval
