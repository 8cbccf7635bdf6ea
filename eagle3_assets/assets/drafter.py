"""`drafter`: the EAGLE-3 drafter trained with training-time test over all shards."""

import math
import random

from dagster import AssetExecutionContext, MaterializeResult, MetadataValue, asset

from ..core.hidden_states import MANIFEST
from ..core.target import pick_device, resolve_target
from ..core.export import export_speculators, validate_for_engine, write_engine_checkpoint
from ..core.train import TrainConfig, list_samples, load_target_head, plan_epoch, train_drafter
from ..resources import layout, shards
from ..settings import Settings

CODE_VERSION = "1"
SETTINGS_USED = ("target_model", "extraction.aux_layer_ids", "vocab.draft_vocab_size", "training")


def build(settings: Settings):
    paths = layout(settings)
    tr = settings.training

    @asset(
        name="drafter",
        deps=["hidden_states", "vocab_map"],
        code_version=f"{CODE_VERSION}-{settings.fingerprint(*SETTINGS_USED)}",
        description="EAGLE-3 checkpoint (config.json + model.safetensors) that vLLM and SGLang load.",
    )
    def drafter(context: AssetExecutionContext) -> MaterializeResult:
        keys = context.instance.get_dynamic_partitions(shards.name)
        incomplete = [k for k in keys if not (paths.hidden_states(k) / MANIFEST).is_file()]
        if not keys or incomplete:
            raise FileNotFoundError(f"drafter needs every shard's hidden states; incomplete: {incomplete or 'all (no shards)'}")
        shard_dirs = [paths.hidden_states(k) for k in keys]
        model_dir = resolve_target(settings.target_model, settings.model_cache_dir)
        aux_ids = _aux_layer_ids(shard_dirs[0])
        cfg = TrainConfig(
            steps_ttt=tr.ttt_steps,
            loss_decay=tr.loss_decay,
            lr=tr.lr,
            warmup_steps=tr.warmup_steps,
            batch_tokens=tr.batch_tokens,
            grad_clip=tr.grad_clip,
            weight_decay=tr.weight_decay,
            seed=tr.seed,
            max_length=settings.max_prompt_tokens + settings.generation.max_new_tokens,
            device=str(pick_device(tr.device)),
        )
        batches = len(plan_epoch(list_samples(shard_dirs), cfg.batch_tokens, cfg.max_length, random.Random(0)))
        cfg.max_steps = max(1, math.ceil(tr.epochs * batches))
        context.log.info(f"training {cfg.max_steps} steps ({tr.epochs} epochs of {batches} batches) on {cfg.device}")
        m = train_drafter(
            shard_dirs, model_dir, paths.vocab_map, paths.drafter, aux_ids, settings.vocab.draft_vocab_size, cfg,
            log=context.log.info,
        )
        # One copy per serving engine: each reads the layer ids from a different place and in a
        # different numbering (README, "Layer ids"); the validator checks each copy as its engine would.
        exports = {e: write_engine_checkpoint(paths.drafter, paths.drafter_export(e), e) for e in ("vllm", "sglang")}
        embed, _, _ = load_target_head(model_dir)
        exports["speculators"] = export_speculators(
            paths.drafter, paths.drafter_export("speculators"), embed, settings.target_model,
            speculative_tokens=tr.ttt_steps,
        )
        for engine, path in (("vllm", exports["vllm"]), ("sglang", exports["sglang"]), ("vllm", exports["speculators"])):
            problems = validate_for_engine(path, engine, extracted_layer_ids=aux_ids)
            if problems:
                raise ValueError(f"drafter export {path} would not load correctly in {engine}: {problems}")
        acc = m["step_accuracy"]
        return MaterializeResult(
            metadata={
                "steps": m["steps"],
                "tokens_seen": m["tokens_seen"],
                "final_loss": round(m["final_loss"], 5),
                **{f"accuracy_step_{k}": round(a, 5) for k, a in enumerate(acc)},
                "per_step_accuracy": MetadataValue.json([round(a, 5) for a in acc]),
                "loss_history": MetadataValue.json([round(x, 5) for x in m["loss_history"]]),
                "train_s": round(m["train_s"], 2),
                "tokens_per_s": round(m["tokens_per_s"], 1),
                "aux_layer_ids": MetadataValue.json(aux_ids),
                "device": cfg.device,
                "path": MetadataValue.path(str(paths.drafter)),
                **{f"export_{e}": MetadataValue.path(str(p)) for e, p in exports.items()},
            }
        )

    return drafter


def _aux_layer_ids(shard_dir) -> list[int]:
    """The layer ids the shard was extracted with, from a sample file's metadata."""
    from safetensors import safe_open

    first = next(shard_dir.glob("*.safetensors"))
    with safe_open(str(first), framework="pt") as f:
        return [int(x) for x in f.metadata()["aux_layer_ids"].split(",")]
