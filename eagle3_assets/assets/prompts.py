"""`prompts`: normalize the prompt sources, drop what overlaps the evaluation sets, register the shard partitions."""

import hashlib
from pathlib import Path

import polars as pl

from dagster import AssetExecutionContext, DataVersion, MaterializeResult, MetadataValue, asset

from ..core.files import atomic_write_parquet
from ..core.generate import template_ids
from ..core.prompts import PROMPTS_SCHEMA, PromptTable, _quota, as_sources, file_sha256, read_prompts, sources_sha256
from ..core.self_prompts import SELF_WRITTEN
from ..core.shards import shard_keys
from ..core.target import load_tokenizer, resolve_target
from ..partitions import shards
from ..resources import layout
from ..settings import Settings

CODE_VERSION = "2"  # 2: later turns, source column, mixtures, decontamination
JOB = "prompts_job"  # the code location's job that materializes it (`eagle3 run`, the UI)
SETTINGS_USED = ("target_model", "prompts_source", "max_prompts", "max_prompt_tokens", "shard_size", "decontaminate",
                 "eval.prompt_sets", "generation.turns")
# what shapes the requests of generator:self (only then: other runs keep their versions)
SETTINGS_USED_SELF = ("self_prompts", "generation.engine", "generation.dtype", "generation.device")


def settings_used(settings: Settings) -> tuple[str, ...]:
    return SETTINGS_USED + (SETTINGS_USED_SELF if writes_itself(settings) else ())


def writes_itself(settings: Settings) -> bool:
    return any(e.source == SELF_WRITTEN for e in as_sources(settings.prompts_source))


def data_version(settings: Settings, source_sha256: str | None = None) -> str:
    """The prompt sources' content and the settings that shape the table: equal versions, equal rows.
    `eagle3 run` compares it with the last materialization's to know whether a file changed."""
    sha = source_sha256 or sources_sha256(settings.prompts_source)
    eval_files = [Path(p) for p in settings.eval.prompt_sets if Path(p).is_file()]
    if settings.decontaminate and eval_files:  # an edited evaluation file changes what is dropped
        sha += ":" + ":".join(file_sha256(p) for p in eval_files)
    return hashlib.sha256(f"{sha}:{settings.fingerprint(*settings_used(settings))}".encode()).hexdigest()[:16]


def build_table(settings: Settings, log=lambda msg: None, self_writer=None, quick: bool = False):
    """The prompts table these settings make (what the asset writes, and what `eagle3 plan` plans
    from), and a function giving each row's templated prompt length (computed once, here; None
    with `quick`). `self_writer` (`self_prompts.SelfWriter`) writes `generator:self`'s requests;
    without one (the plan), that source's rows are placeholders: its cap of them, empty prompts.
    `quick` (`eagle3 plan --quick`): no tokenizer, so no length check and no decontamination;
    both only drop rows, so the table is an upper bound."""
    length = None
    too_long = contaminated = None
    if not quick:
        tok = load_tokenizer(resolve_target(settings.target_model, settings.model_cache_dir))
        lengths: dict[tuple, int] = {}

        def length(system, prompt) -> int:
            if (system, prompt) not in lengths:
                lengths[(system, prompt)] = len(template_ids(tok, system, prompt))
            return lengths[(system, prompt)]

        def too_long(system, prompt):
            return length(system, prompt) > settings.max_prompt_tokens

        if settings.decontaminate:
            from ..core.decontaminate import Decontaminator, eval_texts

            decon = Decontaminator(eval_texts(settings.eval.prompt_sets))
            contaminated = decon.contaminated
            log(f"decontamination against {decon.count} evaluation texts of {settings.eval.prompt_sets}")
    entries = as_sources(settings.prompts_source)
    placeholders = self_writer is None and writes_itself(settings)
    read = [e for e in entries if e.source != SELF_WRITTEN] if placeholders else entries
    table = read_prompts(read, settings.max_prompts, too_long, contaminated,
                         whole_conversations=settings.generation.turns == "all", self_writer=self_writer) if read else None
    if placeholders:
        n = sum(_quota(e, settings.max_prompts) for e in entries if e.source == SELF_WRITTEN)
        rows = pl.concat([*([table.rows] if table else []), pl.DataFrame(
            {"row_id": [0] * n, "system": [None] * n, "prompt": [""] * n, "later_turns": [[]] * n,
             "source": [SELF_WRITTEN] * n, "source_index": list(range(n))}, schema=PROMPTS_SCHEMA)])
        rows = (rows.head(settings.max_prompts) if settings.max_prompts else rows).with_columns(
            pl.int_range(pl.len(), dtype=pl.Int64).alias("row_id"))
        table = PromptTable(rows, table.dropped if table else {}, table.source if table else SELF_WRITTEN, "",
                            [*(table.sources if table else []), {"source": SELF_WRITTEN, "rows": n, "placeholders": True}])
    return table, length


def build(settings: Settings):
    paths = layout(settings)

    @asset(
        name="prompts",
        group_name="data",
        kinds={"parquet"},
        code_version=f"{CODE_VERSION}-{settings.fingerprint(*settings_used(settings))}",
        description="Normalized prompts (Parquet, row ids 0..N-1); registers the shard partitions.",
    )
    def prompts(context: AssetExecutionContext) -> MaterializeResult:
        writer = None
        if writes_itself(settings):
            from ..core.export import verifier_name
            from ..core.self_prompts import SelfWriter

            writer = SelfWriter(settings.generation, settings.self_prompts,
                                resolve_target(settings.target_model, settings.model_cache_dir),
                                _target_label(settings.target_model, verifier_name), log=context.log.info)
        try:
            table, _ = build_table(settings, log=context.log.info, self_writer=writer)
        finally:
            if writer is not None:
                writer.close()
        atomic_write_parquet(table.rows, paths.prompts)

        keys = shard_keys(len(table.rows), settings.shard_size)
        instance = context.instance
        existing = set(instance.get_dynamic_partitions(shards.name))
        stale = sorted(existing - set(keys))
        for key in stale:  # shards of an earlier prompt set that no longer exist
            instance.delete_dynamic_partition(shards.name, key)
        instance.add_dynamic_partitions(shards.name, [k for k in keys if k not in existing])
        context.log.info(f"{len(table.rows)} prompts in {len(keys)} shards; removed stale shards {stale}")

        counts = ({"contaminated": 0} if settings.decontaminate else {}) | table.dropped  # 0 says it was checked
        dropped = {f"dropped_{reason}": n for reason, n in sorted(counts.items())}
        return MaterializeResult(
            metadata={
                "rows": len(table.rows),
                "dropped": sum(table.dropped.values()),
                **dropped,
                "shards": len(keys),
                "shard_keys": MetadataValue.json(keys),
                "source": MetadataValue.path(table.source),
                # per source: rows, licence, cap, drops; and the licences on their own to read at a glance
                "sources": MetadataValue.json(table.sources),
                "licences": MetadataValue.md("\n".join(f"- `{r['source']}`: {r['rows']} rows, {r['licence']}"
                                                       for r in table.sources)),
                **{f"rows_{_key(r['source'])}": r["rows"] for r in table.sources if len(table.sources) > 1},
                "conversations_with_later_turns": int((table.rows["later_turns"].list.len() > 0).sum()),
                "later_turns": int(table.rows["later_turns"].list.len().sum()),
                **({"self_written_requests": writer.requests} if writer is not None else {}),
                "sha256": table.sha256,
                "path": MetadataValue.path(str(paths.prompts)),
            },
            data_version=DataVersion(data_version(settings, table.sha256)),
        )

    return prompts


def _key(source: str) -> str:
    """A metadata key for a source: its file stem or embedded/generator name."""
    name = source.split("/")[-1].split(":")[-1].rsplit(".", 1)[0]
    return "".join(c if c.isalnum() else "_" for c in name)[:40]


def _target_label(target_model: str, verifier_name) -> str:
    """The target as its licence line names it: its Hugging Face id when known, else as given."""
    try:
        return verifier_name(target_model)
    except ValueError:
        return target_model
