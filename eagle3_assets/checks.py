"""Asset checks: they run with their asset and block what is downstream when they fail."""

import torch
from dagster import AssetCheckExecutionContext, AssetCheckResult, MetadataValue, asset_check
from transformers import AutoConfig

from .assets.hidden_states import sample_layout
from .core.drafter import load_checkpoint
from .core.target import resolve_target
from .core.verify import verify_shard
from .core.vocab import load_vocab_map
from .partitions import shards
from .resources import layout
from .settings import Settings


def build(settings: Settings) -> list:
    paths = layout(settings)

    def target_config():
        return AutoConfig.from_pretrained(resolve_target(settings.target_model, settings.model_cache_dir))

    @asset_check(asset="hidden_states", partitions_def=shards, blocking=True, name="shard_complete")
    def shard_complete(context: AssetCheckExecutionContext) -> AssetCheckResult:
        """Files = rows of the settings' layout, manifest present, no temporaries, bytes as predicted,
        spot-checked files finite."""
        shard = context.partition_key
        passed, d = verify_shard(
            paths.hidden_states(shard), paths.generations(shard), sample_layout(settings, target_config().hidden_size),
        )
        return AssetCheckResult(
            passed=passed,
            description="; ".join(d["problems"]) or "complete",
            metadata={k: MetadataValue.json(v) if isinstance(v, list) else v for k, v in d.items()},
        )

    @asset_check(asset="vocab_map", blocking=True, name="vocab_map_consistent")
    def vocab_map_consistent() -> AssetCheckResult:
        """i + d2t[i] are exactly the t2d ids, of the configured sizes."""
        try:
            d2t, t2d = load_vocab_map(paths.vocab_map)
        except Exception as e:  # the loader names what is inconsistent
            return AssetCheckResult(passed=False, description=str(e))
        size = settings.vocab.draft_vocab_size  # with vocab.coverage, the upper bound of the chosen size
        ok = (d2t.numel() <= size if settings.vocab.coverage else d2t.numel() == size) and (
            t2d.numel() == target_config().vocab_size)
        return AssetCheckResult(passed=ok, metadata={"draft_vocab_size": d2t.numel(), "target_vocab_size": t2d.numel()})

    @asset_check(asset="drafter", blocking=True, name="drafter_loads")
    def drafter_loads() -> AssetCheckResult:
        """The checkpoint loads with every contract key and runs a finite forward."""
        cfg = target_config()
        try:
            model = load_checkpoint(paths.drafter, torch.zeros(cfg.vocab_size, cfg.hidden_size))
            ids = torch.randint(0, cfg.vocab_size, (1, 8))
            logits = model.ttt_forward(ids, torch.randn(1, 8, 3 * cfg.hidden_size), steps=1)[0]
        except Exception as e:
            return AssetCheckResult(passed=False, description=f"{type(e).__name__}: {e}")
        return AssetCheckResult(passed=bool(torch.isfinite(logits).all()), metadata={"logits_shape": str(tuple(logits.shape))})

    return [shard_complete, vocab_map_consistent, drafter_loads]
