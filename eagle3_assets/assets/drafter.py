"""`drafter`: the EAGLE-3 drafter trained with training-time test over all shards."""

import json
import math
import random
from dataclasses import asdict

from dagster import AssetExecutionContext, MaterializeResult, MetadataValue, asset

from ..core.hidden_states import MANIFEST
from ..core.target import pick_device, resolve_target
from ..core.export import export_speculators, validate_for_engine, write_engine_checkpoint
from ..core.train import TrainConfig, list_samples, load_target_head, plan_epoch
from ..resources import GPU_POOL, GPU_RETRY, launch_command, layout, pipes_client, shards
from ..settings import Settings

CODE_VERSION = "1"
SETTINGS_USED = ("target_model", "extraction.aux_layer_ids", "vocab.draft_vocab_size", "training")


def build(settings: Settings):
    paths = layout(settings)
    tr = settings.training

    @asset(
        name="drafter",
        deps=["hidden_states", "vocab_map"],
        pool=GPU_POOL,
        retry_policy=GPU_RETRY,
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
            state_path=str(paths.drafter_state),
            save_every=tr.save_every,
        )
        batches = len(plan_epoch(list_samples(shard_dirs), cfg.batch_tokens, cfg.max_length, random.Random(0)))
        cfg.max_steps = max(1, math.ceil(tr.epochs * batches))
        context.log.info(f"training {cfg.max_steps} steps ({tr.epochs} epochs of {batches} batches) on {cfg.device}")
        params = {
            "shard_dirs": [str(d) for d in shard_dirs],
            "target_model_dir": str(model_dir),
            "vocab_map_path": str(paths.vocab_map),
            "out_dir": str(paths.drafter),
            "aux_layer_ids": aux_ids,
            "draft_vocab_size": settings.vocab.draft_vocab_size,
            "cfg": asdict(cfg),
        }
        trained = pipes_client().run(
            command=launch_command("eagle3_assets.jobs.train_drafter", tr.nproc),
            context=context,
            env={"EAGLE3_TRAIN_PARAMS": json.dumps(params)},
        ).get_materialize_result()

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
        return MaterializeResult(
            metadata={**trained.metadata, **{f"export_{e}": MetadataValue.path(str(p)) for e, p in exports.items()}}
        )

    return drafter


def _aux_layer_ids(shard_dir) -> list[int]:
    """The layer ids the shard was extracted with, from a sample file's metadata."""
    from safetensors import safe_open

    first = next(shard_dir.glob("*.safetensors"))
    with safe_open(str(first), framework="pt") as f:
        return [int(x) for x in f.metadata()["aux_layer_ids"].split(",")]
