"""One shape for every stage: a `StageSpec` says what the asset is (name, deps, partitions, the
settings it reads, its job), `make_asset` turns it into the Dagster asset for some settings.

The stage modules hold only their spec and their body, `materialize(context, settings, paths)`
(and `launcher` for a GPU stage); what the `@asset` decorators repeated is written once here.

A stage over several shards at once (`run_shards`: generations, hidden_states) gets the
multi-shard mode below: one run over a range of shards (a UI backfill, or `eagle3 run`;
`BackfillPolicy.single_run()`) shares one model load (`launch_shards`: one launcher job), and
each shard stays its own partition: its own materialization and metadata, its own blocking
check where the spec has one (`shard_check_spec`, evaluated by `check_shard`), its own failure.
A shard that fails leaves the others materialized, and the run fails naming it. Dagster's step
retry (the spec's `retry_policy`) reruns only the shards the run has not materialized yet. A stop
on purpose, or a failure no retry helps (`"final"`, a failed check), is `Failure(allow_retries=False)`. A run
where every shard succeeded returns one output with per-shard metadata; one where some failed
logs the others' materializations as events (with the data-version tags Dagster would have given
them) before it fails."""

from dataclasses import dataclass, replace
from typing import Callable

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
    Output,
    PartitionsDefinition,
    ResourceParam,
    RetryPolicy,
    asset,
)

from .core import stopping
from .dagster_compat import DATA_VERSION_TAG, version_tags
from .launchers import GpuJob, Launcher
from .policies import FORCE_TAG
from .records import latest
from .resources import layout
from .settings import Settings


SHARD_LABEL = "eagle3.dev/shard"  # a job's shard, or range of shards, among its labels (a pod's on Kubernetes)


def versioned(code_version: str, *settings_used: str) -> Callable[[Settings], str]:
    """The usual code version: the stage's own, and a fingerprint of the settings it reads (so
    changing one marks exactly the affected assets stale)."""
    return lambda settings: f"{code_version}-{settings.fingerprint(*settings_used)}"


@dataclass(frozen=True)
class StageSpec:
    name: str
    group: str
    kinds: tuple[str, ...]
    description: str
    job: str  # the code location's job that materializes it (`eagle3 run`, the UI)
    code_version: Callable[[Settings], str]
    materialize: Callable[..., MaterializeResult] | None = None  # (context, settings, paths[, launcher])
    deps: tuple[str, ...] | Callable[[Settings], list[str]] = ()
    partitions: PartitionsDefinition | None = None
    pool: str | None = None  # GPU stages: one GPU job holds the node at a time
    retry_policy: RetryPolicy | None = None
    launcher: bool = False  # whether the body takes the `launcher` resource (a GPU job)
    # The multi-shard mode, instead of `materialize`: (context, settings, paths, launcher, shards,
    # redo) -> for every shard given, {"metadata"} or {"error", "final" (no retry helps)}.
    run_shards: Callable[..., dict[str, dict]] | None = None
    shard_check_spec: AssetCheckSpec | None = None  # blocking, per shard, evaluated in the step by `check_shard`
    check_shard: Callable[[Settings, str], tuple[bool, str, dict]] | None = None  # (passed, description, metadata)
    shard_deps: tuple[str, ...] = ()  # the deps partitioned as this asset (read at the same shard)

    def deps_for(self, settings: Settings) -> list[str]:
        return list(self.deps(settings) if callable(self.deps) else self.deps)

    def build(self, settings: Settings):
        return make_asset(self, settings)


def make_asset(spec: StageSpec, settings: Settings):
    """The Dagster asset of `spec` with `settings` closed over."""
    paths = layout(settings)
    shards = spec.run_shards is not None
    decorate = asset(
        name=spec.name,
        group_name=spec.group,
        kinds=set(spec.kinds),
        deps=spec.deps_for(settings),
        partitions_def=spec.partitions,
        pool=spec.pool,
        retry_policy=spec.retry_policy,
        code_version=spec.code_version(settings),
        description=spec.description,
        # each shard is reported by its own events
        **({"backfill_policy": BackfillPolicy.single_run(), "output_required": False,
            "check_specs": [spec.shard_check_spec] if spec.shard_check_spec else None} if shards else {}),
    )
    if shards:
        return decorate(_shards_body(spec, settings, paths))
    if spec.launcher:  # Dagster reads the resources an asset needs from its signature
        def body(context: AssetExecutionContext, launcher: ResourceParam[Launcher]) -> MaterializeResult:
            return spec.materialize(context, settings, paths, launcher)
    else:
        def body(context: AssetExecutionContext) -> MaterializeResult:
            return spec.materialize(context, settings, paths)
    return decorate(body)


class ShardsFailed(RuntimeError):
    pass


def _shards_body(spec: StageSpec, settings: Settings, paths):
    key, check = AssetKey(spec.name), spec.shard_check_spec
    version, upstream = spec.code_version(settings), spec.deps_for(settings)

    def body(context: AssetExecutionContext, launcher: ResourceParam[Launcher]):
        keys = context.partition_keys
        # A step retry re-runs only the shards this run has not materialized yet (the job may resume
        # from what they left); --force redoes the shards on the first attempt only.
        done_before = _materialized_in_run(context, key, keys) if context.retry_number else set()
        pending = [s for s in keys if s not in done_before]
        if done_before:
            context.log.warning(f"retry {context.retry_number}: running the {len(pending)} shard(s) not yet "
                                f"materialized: {pending}")
        redo = not context.retry_number and FORCE_TAG in context.run.tags
        results = spec.run_shards(context, settings, paths, launcher, pending, redo)

        done, failed, retriable = {}, [], False
        for shard in pending:
            result = results[shard]
            if "error" in result:
                context.log.error(f"shard {shard} failed: {result['error']}")
                failed.append(f"{shard}: {result['error']}")
                retriable = retriable or not result.get("final")
            else:
                done[shard] = result["metadata"]
        if failed or done_before:  # Dagster's output would mark every shard of the run materialized: report these alone
            for shard, metadata in done.items():
                context.log_event(AssetMaterialization(asset_key=key, partition=shard, metadata=metadata,
                                                       tags=_version_tags(context, shard, version, upstream, spec.shard_deps)))
        else:
            for shard, metadata in done.items():
                context.add_asset_metadata(metadata, partition_key=shard)
            yield MaterializeResult()  # one materialization per shard, each with its own metadata
        for shard in done if check else ():
            passed, description, check_metadata = spec.check_shard(settings, shard)
            context.log_event(AssetCheckEvaluation(asset_key=key, check_name=check.name, passed=passed, partition=shard,
                                                   description=description, metadata=check_metadata, blocking=True))
            if not passed:  # blocking: the run fails, so nothing downstream reads a damaged shard
                failed.append(f"{shard}: check {check.name} failed: {description}")  # materialized: a retry skips it
        if check:
            yield Output(None, output_name=context.assets_def.get_output_name_for_asset_check_key(
                AssetCheckKey(key, check.name)))
        if failed:
            message = (f"{len(failed)} of {len(keys)} shard(s) failed (the others are materialized; rerun the "
                       "failed ones): " + " | ".join(failed))
            if stopping.requested() or not retriable:  # a stop on purpose, or failures no retry can help
                raise Failure(message, allow_retries=False) from ShardsFailed(message)
            raise ShardsFailed(message)

    return body


def launch_shards(context: AssetExecutionContext, launcher: Launcher, job: GpuJob,
                  shards: list[str]) -> dict[str, dict]:
    """Run `job` over `shards` (a multi-shard job whose entry module sends one custom message per
    shard, `{"shard", "metadata"}` or `{"shard", "error"}`); each shard's message, and an error for
    each shard the job did not report. `job` gets the range as its `SHARD_LABEL`."""
    label = shards[0] if len(shards) == 1 else f"{shards[0]}..{shards[-1]}"
    job = replace(job, labels={**job.labels, SHARD_LABEL: label})
    try:
        results = {m["shard"]: m for m in launcher.run(context, job).get_custom_messages()}
    except Exception as e:  # the job died (killed, preempted, out of memory): every shard it had not reported
        context.log.error(f"the {job.name} job failed: {e}")
        # the local launcher keeps the messages sent before the end (`custom_messages`): those shards are done
        results = {**{s: {"error": f"the {job.name} job failed before this shard was done: {type(e).__name__}: {e}"}
                      for s in shards},
                   **{m["shard"]: m for m in getattr(e, "custom_messages", [])}}
    return {s: results.get(s, {"error": f"the {job.name} job ended without reporting this shard"}) for s in shards}


def _materialized_in_run(context: AssetExecutionContext, key: AssetKey, keys: list[str]) -> set[str]:
    """The shards an earlier attempt of this run materialized (a step retry skips them)."""
    events = context.instance.all_logs(context.run.run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION)
    return {e.dagster_event.partition for e in events if e.dagster_event.asset_key == key} & set(keys)


def _version_tags(context: AssetExecutionContext, shard: str, code_version: str, upstream: list[str],
                  shard_deps: tuple[str, ...]) -> dict[str, str]:
    """The data-version tags Dagster gives an asset's own output, per shard: the code version,
    the version of each input it read (a partitioned one at this shard) and the logical version
    of them all."""
    inputs = {}
    for name in upstream:
        dep = AssetKey(name)
        record = latest(context.instance, dep, shard if name in shard_deps else None)
        inputs[dep] = ((record.asset_materialization.tags or {}).get(DATA_VERSION_TAG), record.storage_id) \
            if record is not None else (None, None)
    return version_tags(code_version, inputs)
