"""`drafter_eval`: acceptance length (tau) by real greedy speculative decoding on held-out prompts;
then the drafter's model card (README.md beside the drafter and each export), from what the run
recorded.

The evaluation runs in its own process (a pod on Kubernetes), started by the `launcher` resource
through Dagster Pipes; it writes its result to `drafter_eval/`, which this asset reads."""

import json
from dataclasses import asdict
from datetime import datetime, timezone

from dagster import AssetExecutionContext, MaterializeResult, MetadataValue, ResourceParam, asset

from ..core.evaluate import EvalJob
from ..core.export import verifier_name
from ..core.files import atomic_write_text
from ..core.model_card import CARD_NAME, model_card
from ..core.report import comparison_markdown, drafter_rows, manifests_summary, settings_snapshot, snapshot_sha256
from ..core.target import describe_target, resolve_target
from ..launchers import GpuJob, Launcher
from ..partitions import shards
from ..policies import GPU_POOL
from ..records import latest_metadata, materializations, values
from ..resources import layout
from ..settings import Settings

CODE_VERSION = "3"
JOB = "drafter_job"  # the code location's job that materializes it (`eagle3 run`, the UI)
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
    def drafter_eval(context: AssetExecutionContext, launcher: ResourceParam[Launcher]) -> MaterializeResult:
        model_dir = resolve_target(settings.target_model, settings.model_cache_dir)
        job = EvalJob(str(model_dir), str(paths.drafter), settings.eval, result_path=str(paths.drafter_eval))
        gpu_job = GpuJob("evaluate-drafter", "eagle3_assets.entrypoints.evaluate_drafter", job, gpus=1)
        paths.drafter_eval.unlink(missing_ok=True)  # what is read back below is this job's result, never an older one
        reported = launcher.run(context, gpu_job).get_materialize_result().metadata
        r = json.loads(paths.drafter_eval.read_text())  # written by the job
        exports = paths.drafter_exports
        keys = set(context.instance.get_dynamic_partitions(shards.name))
        shards_now = [s for s in manifests_summary(paths.root / "hidden_states") if s[0] in keys]
        card = model_card(
            verifier_name(settings.target_model, model_dir), _latest_metadata(context, "prompts"), shards_now,
            asdict(settings.generation), _latest_metadata(context, "drafter"), r, exports, settings.eval.num_draft_tokens,
            target=describe_target(settings.target_model, model_dir),
        )
        for d in (paths.drafter, *exports.values()):
            atomic_write_text(card, d / CARD_NAME)
        per_set = {f"tau_{name}": round(s["tau"], 4) for name, s in r["sets"].items()}
        record = _record(context, settings, keys, shards_now, _latest_metadata(context, "drafter"),
                         _latest_metadata(context, "prompts"))
        speed = [f"{k}_b{b}" for b in r.get("speedup_batches", [])
                 for k in ("speedup", "greedy_tok_s", "spec_tok_s", "speedup_prompts")]
        optional = {k: round(r[k], 3) if isinstance(r[k], float) else r[k]
                    for k in (*speed, "greedy_check_matches", "greedy_check_prompts") if k in r}
        metadata = {
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
            "device": reported["device"].value,  # `eagle3 plan` times a run from the same kind
            **{k: round(r[k], 2) for k in ("load_s", "acceptance_s", "speedup_s", "check_s", "eval_s")},
            "path": MetadataValue.path(str(paths.drafter_eval)),
            "model_card": MetadataValue.md(card),
            **record,
            "settings": MetadataValue.json(record["settings"]),
            "sources": MetadataValue.json(record["sources"]),
            "model_card_path": MetadataValue.path(str(paths.drafter / CARD_NAME)),
        }
        # every drafter so far, this one last, compared (markdown: the UI shows it; `eagle3 report` prints it)
        this = {"asset": "drafter_eval", "timestamp": datetime.now(timezone.utc).isoformat(), "run_id": context.run_id,
                "metadata": {k: getattr(v, "value", v) for k, v in metadata.items()}}
        comparison = comparison_markdown(drafter_rows(_records(context.instance, "drafter_eval") + [this]))
        return MaterializeResult(metadata={**metadata, "comparison": MetadataValue.md(comparison)})

    return drafter_eval


def _latest_metadata(context: AssetExecutionContext, key: str, partition: str | None = None) -> dict:
    return latest_metadata(context.instance, key, partition)


def _record(context: AssetExecutionContext, settings: Settings, keys: set[str], shards_now: list[tuple],
            drafter: dict, prompts: dict) -> dict:
    """What `eagle3 report` compares drafters by, as this materialization's metadata: the settings
    the drafter was trained with (its own record; the evaluation's from now), the data behind it
    and its training."""
    now = settings_snapshot(settings.model_dump(mode="json"))
    trained = drafter.get("settings") if isinstance(drafter.get("settings"), dict) else None
    snapshot = {**{k: v for k, v in (trained or now).items() if not k.startswith("eval.")},
                **{k: v for k, v in now.items() if k.startswith("eval.")}}
    data_s = 0.0
    for key in sorted(keys):  # the latest generation and extraction of each shard the drafter read
        g, h = _latest_metadata(context, "generations", key), _latest_metadata(context, "hidden_states", key)
        data_s += float(g.get("generate_s") or 0) + float(g.get("model_load_s") or 0)
        data_s += float(h.get("job_s") or h.get("extract_s") or 0)
    return {
        "settings": snapshot,
        "settings_sha256": snapshot_sha256(snapshot),
        "settings_from": "drafter" if trained else "current settings (the drafter recorded none)",
        "samples": sum(s[1] for s in shards_now),
        "tokens": sum(s[2] for s in shards_now),
        "bytes_on_disk": sum(s[3] for s in shards_now),
        "shards": len(shards_now),
        "sources": [{"source": s["source"], "rows": s["rows"]} for s in prompts.get("sources") or []],
        "turns": snapshot.get("generation.turns", "first"),
        "samples_per_prompt": snapshot.get("generation.samples_per_prompt", 0),
        "storage": snapshot.get("extraction.storage", "bf16"),
        "teacher": snapshot.get("extraction.teacher", "last_hidden"),
        "data_s": round(data_s, 1),
        **{k: drafter[src] for k, src in (("train_s", "train_s"), ("train_steps", "steps"), ("epochs", "epochs"))
           if src in drafter},
    }


def _records(instance, asset: str) -> list[dict]:
    """Every materialization of `asset` as a plain dict ({asset, timestamp, run_id, metadata})."""
    return [{"asset": asset, "run_id": r.run_id, "timestamp": datetime.fromtimestamp(r.timestamp, timezone.utc).isoformat(),
             "metadata": values(r.asset_materialization.metadata)} for r in materializations(instance, asset)]
