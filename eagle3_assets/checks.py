"""Asset checks: they run with their asset and block what is downstream when they fail.

`shard_complete` is declared on the `hidden_states` asset and evaluated by it, once per shard
(a run may carry several shards, and Dagster runs a separate check only once per run).
"""

import torch
from dagster import AssetCheckResult, AssetCheckSpec, MetadataValue, asset_check
from transformers import AutoConfig

from .core.drafter import load_checkpoint
from .core.extract_job import extract_layout
from .core.sample_files import SampleLayout
from .core.target import resolve_target
from .core.verify import verify_shard
from .core.vocab import load_vocab_map, vocab_map_fingerprint
from .partitions import shards
from .policies import OPTED_IN  # noqa: F401 (imported first: it silences the preview warning SHARD_CHECK_SPEC opts into)
from .resources import layout
from .settings import Settings

SHARD_CHECK = "shard_complete"
# declared on `hidden_states`, which evaluates it per shard in its step
SHARD_CHECK_SPEC = AssetCheckSpec(SHARD_CHECK, asset="hidden_states", partitions_def=shards, blocking=True,
                                  description="Files = rows, manifest present, no temporaries, bytes as predicted, "
                                              "spot-checked files finite.")


def target_config(settings: Settings):
    return AutoConfig.from_pretrained(resolve_target(settings.target_model, settings.model_cache_dir))


def sample_layout(settings: Settings, hidden_size: int) -> SampleLayout:
    """The layout these settings write; with topk, over the vocab map on disk (when there is one)."""
    paths = layout(settings)
    draft_vocab = None
    if settings.extraction.teacher == "topk" and paths.vocab_map.is_file():
        draft_vocab = vocab_map_fingerprint(load_vocab_map(paths.vocab_map)[0])
    return extract_layout(settings.extraction, hidden_size, draft_vocab)


def shard_complete(settings: Settings, shard: str) -> tuple[bool, str, dict]:
    """Files = rows of the settings' layout, manifest present, no temporaries, bytes as predicted,
    spot-checked files finite: (passed, description, metadata)."""
    paths = layout(settings)
    passed, d = verify_shard(
        paths.hidden_states(shard), paths.generations(shard), sample_layout(settings, target_config(settings).hidden_size),
    )
    return passed, "; ".join(d["problems"]) or "complete", {
        k: MetadataValue.json(v) if isinstance(v, list) else v for k, v in d.items()}


def build(settings: Settings) -> list:
    paths = layout(settings)

    @asset_check(asset="vocab_map", blocking=True, name="vocab_map_consistent")
    def vocab_map_consistent() -> AssetCheckResult:
        """i + d2t[i] are exactly the t2d ids, of the configured sizes."""
        try:
            d2t, t2d = load_vocab_map(paths.vocab_map)
        except Exception as e:  # the loader names what is inconsistent
            return AssetCheckResult(passed=False, description=str(e))
        size = settings.vocab.draft_vocab_size  # with vocab.coverage, the upper bound of the chosen size
        ok = (d2t.numel() <= size if settings.vocab.coverage else d2t.numel() == size) and (
            t2d.numel() == target_config(settings).vocab_size)
        return AssetCheckResult(passed=ok, metadata={"draft_vocab_size": d2t.numel(), "target_vocab_size": t2d.numel()})

    @asset_check(asset="drafter", blocking=True, name="drafter_loads")
    def drafter_loads() -> AssetCheckResult:
        """The checkpoint loads with every contract key and runs a finite forward."""
        cfg = target_config(settings)
        try:
            model = load_checkpoint(paths.drafter, torch.zeros(cfg.vocab_size, cfg.hidden_size))
            ids = torch.randint(0, cfg.vocab_size, (1, 8))
            logits = model.ttt_forward(ids, torch.randn(1, 8, 3 * cfg.hidden_size), steps=1)[0]
        except Exception as e:
            return AssetCheckResult(passed=False, description=f"{type(e).__name__}: {e}")
        return AssetCheckResult(passed=bool(torch.isfinite(logits).all()), metadata={"logits_shape": str(tuple(logits.shape))})

    return [vocab_map_consistent, drafter_loads]
