"""`hidden_states[shard]`: the target's aux hidden states and its teacher signal, one file per sample.

The work runs in its own process (torchrun for several), started by the `launcher` resource
through Dagster Pipes; rank 0 streams progress to the run log and reports each shard.

One run may carry several shards (a UI backfill, or `eagle3 run`, launches one run over a
range of shards: `BackfillPolicy.single_run()`), and they share one model load: a big target
loads once, not once per shard. Each shard stays its own partition: its own materialization
and metadata, its own `shard_complete` check, and its own failure — a shard that fails leaves
the others materialized, and the run fails naming it. A failed shard is retried by Dagster's
step retry (`RETRY`, the GPU assets' `RetryPolicy`): the retry extracts only the shards the run
has not materialized yet, resuming from their valid files. A stop on purpose, or a failure no
retry helps (no generations, a failed check), is `Failure(allow_retries=False)`. The job reports each shard as a Pipes custom message; a run
where every shard succeeded returns one output with per-shard metadata, and one where some
failed logs the others' materializations as events (with the data-version tags Dagster would
have given them) before it fails.

With `extraction.teacher: topk` the files hold top-k log-probabilities over the draft
vocabulary, so the asset depends on `vocab_map` too (the lineage shows it).
"""

from pathlib import Path

from dagster import (
    AssetCheckEvaluation,
    AssetCheckKey,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetKey,
    AssetMaterialization,
    BackfillPolicy,
    DagsterEventType,
    Failure,
    MaterializeResult,
    MetadataValue,
    Output,
    ResourceParam,
    asset,
)

from ..checks import SHARD_CHECK, shard_complete
from ..core import stopping
from ..core.extract_job import ExtractJob, ExtractShards
from ..core.target import resolve_target
from ..dagster_compat import DATA_VERSION_TAG, version_tags
from ..launchers import GpuJob, Launcher
from ..partitions import shards
from ..policies import FORCE_TAG, GPU_POOL, GPU_RETRY
from ..records import latest
from ..resources import layout
from ..settings import Settings

CODE_VERSION = "1"
JOB = "extraction_job"  # the code location's job that materializes it (`eagle3 run`, the UI)
SETTINGS_USED = ("target_model", "extraction.aux_layer_ids", "extraction.dtype")
SHARD_LABEL = "eagle3.dev/shard"
KEY = AssetKey("hidden_states")
# A failed shard is retried by a step retry of the run, which extracts only the shards not yet materialized.
RETRY = GPU_RETRY


class ShardsFailed(RuntimeError):
    pass


def code_version(settings: Settings) -> str:
    """The settings that shape the files. The layout is named only when it is not the default
    bf16/last_hidden, so files made before the layouts existed stay fresh."""
    x = settings.extraction
    named = (x.storage, x.teacher) != ("bf16", "last_hidden")
    layout_part = f"-{x.storage}-{x.teacher}" + (str(x.topk) if x.teacher == "topk" else "") if named else ""
    return f"{CODE_VERSION}-{settings.fingerprint(*SETTINGS_USED)}{layout_part}"


def build(settings: Settings):
    paths = layout(settings)
    version = code_version(settings)
    topk = settings.extraction.teacher == "topk"
    upstream = ["generations", "vocab_map"] if topk else ["generations"]
    check_key = AssetCheckKey(KEY, SHARD_CHECK)

    @asset(
        name="hidden_states",
        group_name="features",
        kinds={"pytorch", "safetensors"},
        deps=upstream,
        partitions_def=shards,
        backfill_policy=BackfillPolicy.single_run(),
        output_required=False,  # each shard is reported by its own events (below)
        check_specs=[AssetCheckSpec(SHARD_CHECK, asset=KEY, partitions_def=shards, blocking=True,
                                    description="Files = rows, manifest present, no temporaries, bytes as predicted, "
                                                "spot-checked files finite.")],
        pool=GPU_POOL,
        retry_policy=RETRY,
        code_version=version,
        description="Per-sample safetensors (input_ids, loss_mask, aux_hidden_states, and last_hidden_state or the "
                    "top-k teacher; bf16 or fp8) + manifest.",
    )
    def hidden_states(context: AssetExecutionContext, launcher: ResourceParam[Launcher]):
        keys = context.partition_keys
        # A step retry (`RETRY`) re-extracts only the shards this run has not materialized yet,
        # resuming from their valid files; --force redoes the files on the first attempt only.
        done_before = _materialized_in_run(context, keys) if context.retry_number else set()
        pending = [s for s in keys if s not in done_before]
        if done_before:
            context.log.warning(f"retry {context.retry_number}: extracting the {len(pending)} shard(s) not yet "
                                f"materialized: {pending}")
        results = extract(context, launcher, pending, redo=not context.retry_number and FORCE_TAG in context.run.tags)

        done, failed, retriable = {}, [], False
        for shard in pending:
            result = results.get(shard, {"error": "the extraction job ended without reporting this shard"})
            if "error" in result:
                context.log.error(f"shard {shard} failed: {result['error']}")
                failed.append(f"{shard}: {result['error']}")
                retriable = retriable or not result.get("final")
            else:
                m = result["metadata"]
                done[shard] = {**m, "path": MetadataValue.path(m["path"]), "aux_layer_ids": MetadataValue.json(m["aux_layer_ids"])}
        if failed or done_before:  # Dagster's output would mark every shard of the run materialized: report these alone
            for shard, metadata in done.items():
                context.log_event(AssetMaterialization(asset_key=KEY, partition=shard, metadata=metadata,
                                                       tags=_version_tags(context, shard, version, upstream)))
        else:
            for shard, metadata in done.items():
                context.add_asset_metadata(metadata, partition_key=shard)
            yield MaterializeResult()  # one materialization per shard, each with its own metadata
        for shard in done:
            passed, description, check_metadata = shard_complete(settings, shard)
            context.log_event(AssetCheckEvaluation(asset_key=KEY, check_name=SHARD_CHECK, passed=passed, partition=shard,
                                                   description=description, metadata=check_metadata, blocking=True))
            if not passed:  # blocking: the run fails, so nothing downstream reads a damaged shard
                failed.append(f"{shard}: check {SHARD_CHECK} failed: {description}")  # materialized: a retry skips it
        yield Output(None, output_name=context.assets_def.get_output_name_for_asset_check_key(check_key))
        if failed:
            message = (f"{len(failed)} of {len(keys)} shard(s) failed (the others are materialized; rerun the "
                       "failed ones, finished sample files are kept): " + " | ".join(failed))
            if stopping.requested() or not retriable:  # a stop on purpose, or failures no retry can help
                raise Failure(message, allow_retries=False) from ShardsFailed(message)
            raise ShardsFailed(message)

    def extract(context: AssetExecutionContext, launcher: Launcher, keys: list[str], redo: bool) -> dict[str, dict]:
        """One job over `keys`, one model load: each shard's message, `{"metadata"}` or `{"error"}`."""
        results, jobs = {}, []
        for shard in keys:
            generations = paths.generations(shard)
            if not generations.is_file():
                results[shard] = {"error": f"no generations for shard {shard} at {generations}; "
                                           f"materialize generations[{shard}] first", "final": True}  # no retry helps
                continue
            jobs.append(ExtractJob(
                generations_path=str(generations),
                shard_dir=str(paths.hidden_states(shard)),
                model_dir=str(resolve_target(settings.target_model, settings.model_cache_dir)),
                target_name=settings.target_model,
                config=settings.extraction,
                vocab_map_path=str(paths.vocab_map) if topk else None,
                redo=redo,
            ))
        if not jobs:
            return results
        names = [Path(j.shard_dir).name for j in jobs]
        gpu_job = GpuJob("extract-hidden-states", "eagle3_assets.entrypoints.extract_hidden_states", ExtractShards(jobs),
                         nproc=settings.extraction.nproc,
                         labels={SHARD_LABEL: names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"})
        try:
            messages = launcher.run(context, gpu_job).get_custom_messages()
        except Exception as e:  # the job died (killed, preempted, out of memory): every shard it had not reported
            context.log.error(f"the extraction job failed: {e}")
            messages = []
            lost = f"the extraction job failed before this shard was done: {type(e).__name__}: {e}"
            results.update({Path(j.shard_dir).name: {"error": lost} for j in jobs})
        for message in messages:
            results[message["shard"]] = message
        return results

    return hidden_states


def _materialized_in_run(context: AssetExecutionContext, keys: list[str]) -> set[str]:
    """The shards an earlier attempt of this run materialized (a step retry skips them)."""
    events = context.instance.all_logs(context.run.run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION)
    return {e.dagster_event.partition for e in events if e.dagster_event.asset_key == KEY} & set(keys)


def _version_tags(context: AssetExecutionContext, shard: str, code_version: str, upstream: list[str]) -> dict[str, str]:
    """The data-version tags Dagster gives an asset's own output, per shard: the code version,
    the version of each input it read (generations[shard], and the vocab map for the top-k
    teacher) and the logical version of them all."""
    inputs = {}
    for name in upstream:
        key = AssetKey(name)
        record = latest(context.instance, key, shard if name == "generations" else None)  # the vocab map is not partitioned
        inputs[key] = ((record.asset_materialization.tags or {}).get(DATA_VERSION_TAG), record.storage_id) \
            if record is not None else (None, None)
    return version_tags(code_version, inputs)
