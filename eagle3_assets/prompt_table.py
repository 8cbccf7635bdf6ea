"""The prompt table some settings make, and its version: what the `prompts` asset writes, what
`eagle3 plan` plans from and what `eagle3 run` compares with the last materialization. Plain
logic on `Settings`, here rather than in core, which does not read the settings."""

import hashlib
from pathlib import Path

import polars as pl

from .core.generate import chat_messages, template_ids
from .core.prompts import PROMPTS_SCHEMA, PromptTable, _quota, as_sources, file_sha256, read_prompts, sources_sha256
from .core.self_prompts import SELF_WRITTEN
from .core.target import load_tokenizer, resolve_target
from .settings import Settings

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


_TOKEN_BOUND_MARGIN = 8  # tokens a template may add beyond one per byte (a BOS, a prefix piece)


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
            # A token covers at least one byte of the templated text (byte-level BPE; SentencePiece
            # with byte fallback adds at most a prefix piece): a text that short needs no
            # tokenizing. Three ShareGPT prompts in four are decided so (the preset's table: 17.5 s -> 11 s on
            # a 2-core CPU).
            text = tok.apply_chat_template(chat_messages(system, prompt), add_generation_prompt=True, tokenize=False)
            if len(text.encode()) + _TOKEN_BOUND_MARGIN <= settings.max_prompt_tokens:
                return False
            return length(system, prompt) > settings.max_prompt_tokens

        if settings.decontaminate:
            from .core.decontaminate import Decontaminator, eval_texts

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


def source_key(source: str) -> str:
    """A metadata key for a source: its file stem or embedded/generator name."""
    name = source.split("/")[-1].split(":")[-1].rsplit(".", 1)[0]
    return "".join(c if c.isalnum() else "_" for c in name)[:40]


def target_label(target_model: str, verifier_name) -> str:
    """The target as its licence line names it: its Hugging Face id when known, else as given."""
    try:
        return verifier_name(target_model)
    except ValueError:
        return target_model


def self_writer(settings: Settings, log):
    """The writer of `generator:self`'s requests (the target writes them); None when no source is."""
    if not writes_itself(settings):
        return None
    from .core.export import verifier_name
    from .core.self_prompts import SelfWriter

    return SelfWriter(settings.generation, settings.self_prompts, resolve_target(settings.target_model, settings.model_cache_dir),
                      target_label(settings.target_model, verifier_name), log=log)
