"""`vocab_map`: the draft vocabulary (`d2t`, `t2d`) from the loss-masked tokens of all shards."""

import polars as pl
from dagster import AssetExecutionContext, MaterializeResult, MetadataValue
from transformers import AutoConfig

from ..core.layout import Layout
from ..core.target import resolve_target
from ..core.vocab import build_vocab_map, choose_draft_vocab_size, count_tokens, coverage, save_vocab_map
from ..partitions import shards
from ..settings import Settings
from ..factory import StageSpec, versioned

CODE_VERSION = "1"
SETTINGS_USED = ("target_model", "vocab")


def materialize(context: AssetExecutionContext, settings: Settings, paths: Layout) -> MaterializeResult:
    keys = context.instance.get_dynamic_partitions(shards.name)
    missing = [k for k in keys if not paths.generations(k).is_file()]
    if not keys or missing:
        raise FileNotFoundError(f"vocab_map needs every shard's generations; missing: {missing or 'all (no shards)'}")
    vocab_size = AutoConfig.from_pretrained(resolve_target(settings.target_model, settings.model_cache_dir)).vocab_size
    samples = (
        (row["input_ids"], row["loss_mask"])
        for k in keys
        for row in pl.read_parquet(paths.generations(k), columns=["input_ids", "loss_mask"]).iter_rows(named=True)
    )
    counts = count_tokens(samples, vocab_size)
    size = choose_draft_vocab_size(counts, settings.vocab)
    d2t, t2d = build_vocab_map(counts, size)
    save_vocab_map(paths.vocab_map, d2t, t2d, {"target_model": settings.target_model, "shards": ",".join(keys)})
    context.log.info(f"draft vocabulary: {size} tokens, coverage {coverage(counts, t2d):.4f}")
    return MaterializeResult(
        metadata={
            "draft_vocab_size": int(d2t.numel()),
            "target_vocab_size": vocab_size,
            "token_coverage": round(coverage(counts, t2d), 6),
            "training_tokens": int(counts.sum()),
            "distinct_tokens": int((counts > 0).sum()),
            "shards": len(keys),
            "path": MetadataValue.path(str(paths.vocab_map)),
        }
    )


SPEC = StageSpec(
    name="vocab_map", group="features", kinds=("safetensors",), job="drafter_job", deps=("generations",),
    code_version=versioned(CODE_VERSION, *SETTINGS_USED), materialize=materialize,
    description="Draft vocabulary: d2t (draft -> target offsets) and t2d (bool over the target vocab).",
)

build = SPEC.build  # the asset for some settings
