"""`eagle3 run`: materialize what is missing or stale, in graph order, and say what is skipped.

An asset (or one shard of it) runs when it was never materialized, when its last attempt
failed (a run that was killed counts as failed), or when Dagster finds it stale: its code
version (which carries the settings it reads) or the data version of an input changed. The
prompt file is hashed on every run, so editing it marks `prompts` stale too. Everything else
is skipped, so a second `eagle3 run` on an unchanged project does no model work, and a run
killed at any moment continues where it stopped: complete shards and sample files are kept,
training continues from its saved state.

Steps run as the code location's jobs (`prompts_job`, `shard_job`, `extraction_job`,
`drafter_job`) with only the assets that need it selected: the prompts, then the generations,
then the hidden states, each of every shard that needs it in as few runs as possible — one run
over each contiguous range of such shards, so the target model loads once per range, not once
per shard (each shard still gets its own materialization, metadata, check and failure) — then
the drafter chain. After a step, what follows is judged again: a rerun whose output did not change
(same code, same inputs) leaves its downstream fresh.

A shard whose files are missing or resized since its manifest runs again (`shard_damage`). SIGTERM
or SIGINT stops the run after the job in flight has saved its work (`core/stopping.py`): no
further step starts and `RunStopped` says which signal. One `eagle3 run` per storage root holds
`exclusive_run`'s lock.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from dagster import AssetKey, DagsterInstance, DagsterRunStatus, Definitions, RunsFilter

from . import prompt_table
from .core import stopping
from .dagster_compat import DATA_VERSION_TAG, RANGE_END_TAG, RANGE_START_TAG, stale_causes
from .core.layout import Layout
from .core.sample_files import MANIFEST, shard_damage
from .definitions import asset_jobs, graph_order
from . import records
from .policies import FORCE_TAG
from .settings import Settings

PID_TAG, HOST_TAG = "eagle3/pid", "eagle3/host"
UNFINISHED = [DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING, DagsterRunStatus.STARTED]


@dataclass(frozen=True)
class Unit:
    """One asset, or one shard of a partitioned asset."""

    asset: str
    partition: str | None = None

    def __str__(self) -> str:
        return self.asset + (f"[{self.partition}]" if self.partition else "")


@dataclass(frozen=True)
class Selection:
    """What `--select` names: asset names and shard keys (`asset[shard]` names both)."""

    assets: frozenset[str] = frozenset()
    shards: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, tokens: list[str] | None, asset_names: list[str]) -> "Selection":
        assets, keys = set(), set()
        for token in (t.strip() for raw in tokens or [] for t in raw.split(",")):
            if not token:
                continue
            name, _, rest = token.partition("[")
            if rest:
                keys.add(rest.rstrip("]"))
            if name in asset_names:
                assets.add(name)
            elif rest or not name.startswith("rows_"):
                raise ValueError(f"--select {token!r}: unknown asset {name!r}; assets are {', '.join(asset_names)}")
            else:
                keys.add(name)
        return cls(frozenset(assets), frozenset(keys))

    def wants(self, unit: Unit) -> bool:
        if self.assets and unit.asset not in self.assets:
            return False
        return not (self.shards and unit.partition is not None and unit.partition not in self.shards)


class Planner:
    """Why a unit must run now, or None; read from the instance (and the prompt file's hash)."""

    def __init__(self, defs: Definitions, instance: DagsterInstance, settings: Settings, force: bool):
        self.defs, self.instance, self.settings, self.force = defs, instance, settings, force
        self.forced: set[Unit] = set()  # --force redoes each unit once

    def reason(self, unit: Unit) -> str | None:
        if self.force and unit not in self.forced:
            return "--force"
        key = AssetKey(unit.asset)
        latest = self._latest(key, unit.partition)
        if latest is None:
            return "never materialized"
        if self._failed_since(key, unit.partition, latest.storage_id):
            return "its last run failed or was killed"
        missing = self._missing(unit)
        if missing is not None:  # e.g. another storage_root: the instance's record is of files elsewhere
            return f"materialized, but {missing} is not there (storage_root changed or files deleted)"
        if unit.asset == "hidden_states":  # cheap: one stat per file against the manifest's sizes
            damage = shard_damage(Layout(self.settings.root).hidden_states(unit.partition))
            if damage:
                return f"damaged: {damage}"
        if unit.asset == "prompts":
            current = prompt_table.data_version(self.settings)
            if latest.asset_materialization.tags.get(DATA_VERSION_TAG) != current:
                return "the prompt file or its settings changed"
        causes = stale_causes(self.defs, self.instance, key, unit.partition)
        if causes is not None:
            return "stale: " + "; ".join(causes) if causes else "stale"
        return None

    def _missing(self, unit: Unit):
        """The file that says the unit is on disk under this storage root, if it is absent."""
        paths = Layout(self.settings.root)
        where = {
            "prompts": lambda: paths.prompts,
            "generations": lambda: paths.generations(unit.partition),
            "hidden_states": lambda: paths.hidden_states(unit.partition) / MANIFEST,
            "vocab_map": lambda: paths.vocab_map,
            "drafter": lambda: paths.drafter / "config.json",
            "drafter_eval": lambda: paths.drafter_eval,
        }.get(unit.asset)
        path = where() if where else None
        return path if path is not None and not path.exists() else None

    def materialized_by(self, unit: Unit, run_id: str) -> bool:
        """The unit's latest materialization is from that run (a run over several shards may fail
        for some of them only)."""
        latest = self._latest(AssetKey(unit.asset), unit.partition)
        return latest is not None and latest.run_id == run_id

    def _latest(self, key: AssetKey, partition: str | None):
        return records.latest(self.instance, key, partition)

    def _failed_since(self, key: AssetKey, partition: str | None, storage_id: int) -> bool:
        """A materialization was planned after the latest one, and its run did not succeed."""
        planned = self.instance.get_latest_planned_materialization_info(key, partition)
        if planned is None or planned.storage_id <= storage_id:
            return False
        run = self.instance.get_run_by_id(planned.run_id)
        return run is None or run.status != DagsterRunStatus.SUCCESS


def _ranges(keys: list[str], wanted) -> list[list[str]]:
    """The `wanted` keys as maximal runs of consecutive `keys`."""
    out: list[list[str]] = []
    prev = None
    for i, k in enumerate(keys):
        if k not in wanted:
            continue
        if out and prev == i - 1:
            out[-1].append(k)
        else:
            out.append([k])
        prev = i
    return out


class RunStopped(RuntimeError):
    """`eagle3 run` was asked to stop (SIGTERM, SIGINT): its jobs saved their state, nothing more runs."""

    def __init__(self, signal_name: str):
        self.signal_name = signal_name
        super().__init__(f"stopped by {signal_name}: finished work is kept (training saved its state, extraction "
                         "its written files); the next `eagle3 run` continues from there")

    @property
    def exit_code(self) -> int:
        return 128 + getattr(signal, self.signal_name, signal.SIGINT)


class AnotherRun(RuntimeError):
    pass


@contextmanager
def exclusive_run(storage_root: Path) -> Iterator[None]:
    """One `eagle3 run` per storage root at a time: an flock on `<storage_root>/.eagle3-run.lock`,
    released by the kernel when the holder exits (or is killed). Two runs would both generate
    and extract every shard (the `gpu` pool is not enforced across processes)."""
    storage_root.mkdir(parents=True, exist_ok=True)
    with open(storage_root / ".eagle3-run.lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            raise AnotherRun(f"another eagle3 run, pid {holder}, is active on {storage_root}; wait for it to end "
                             "or stop it (SIGTERM or Ctrl-C: it saves its state), then run again") from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        yield


def _stop_signal(result) -> str | None:
    """The signal that stopped this process during `result`'s run: ours (`stopping.request`, while
    a job ran) or Dagster's interrupt raised inside a step's own code."""
    if stopping.requested():
        return stopping.requested()
    for event in result.all_events:
        error = event.step_failure_data.error if event.is_step_failure else None
        while error is not None:
            if error.cls_name in ("DagsterExecutionInterruptedError", "KeyboardInterrupt"):
                return "SIGINT or SIGTERM"
            error = error.cause
    return None


def mark_killed_runs(instance: DagsterInstance, log: Callable[[str], None]) -> None:
    """Runs of an `eagle3 run` process that died (killed, machine lost) stay "started" forever in
    the instance; report them failed, so the UI and the planner see them as they are."""
    host = socket.gethostname()
    for run in instance.get_runs(RunsFilter(statuses=UNFINISHED, tags={HOST_TAG: host})):
        pid = int(run.tags.get(PID_TAG, "0"))
        if pid and not _alive(pid):
            instance.report_run_failed(run, f"the eagle3 run process {pid} that ran it is gone (killed?)")
            log(f"run {run.run_id[:8]} ({run.job_name}) was left unfinished by process {pid}: marked failed")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_pipeline(
    defs: Definitions,
    instance: DagsterInstance,
    settings: Settings,
    *,
    force: bool = False,
    select: list[str] | None = None,
    log: Callable[[str], None] = print,
) -> bool:
    """Materialize what needs it: prompts, then the generations and the hidden states of the shards
    that need them (one run, one model load, per contiguous range each), then the
    vocab map, drafter and its evaluation (with `extraction.teacher: topk` the vocab map comes
    between the generations and the hidden states). A failed shard is named and the others still run; the
    drafter chain waits for every shard."""
    order = graph_order(defs)
    graph, job_of = defs.resolve_asset_graph(), asset_jobs(defs)
    selection = Selection.parse(select, order)
    planner = Planner(defs, instance, settings, force)
    mark_killed_runs(instance, log)
    tags = {PID_TAG: str(os.getpid()), HOST_TAG: socket.gethostname(), **({FORCE_TAG: "1"} if force else {})}
    ran, skipped = [], []

    def check_stopped(result=None) -> None:
        name = _stop_signal(result) if result is not None else stopping.requested()
        if name:
            raise RunStopped(name)

    def step(job: str, units: list[Unit]) -> bool:
        """Run the units of one job that need it, until none does (or a run fails)."""
        units = [u for u in units if selection.wants(u)]
        for _ in range(len(units)):
            check_stopped()
            todo = [(u, r) for u in units if (r := planner.reason(u))]
            if not todo:
                break
            for u, r in todo:
                log(f"-> {u}: {r}")
            planner.forced.update(u for u, _ in todo)
            partition = units[0].partition
            label = f"{job}[{partition}]" if partition else job
            result = defs.resolve_job_def(job).execute_in_process(
                instance=instance,
                partition_key=partition,
                asset_selection=[AssetKey(u.asset) for u, _ in todo],
                tags=tags,
                raise_on_error=False,
                # Progress and errors, not every engine event; the UI keeps the full log.
                run_config={"loggers": {"console": {"config": {"log_level": "INFO"}}}},
            )
            ran.extend(str(u) for u, _ in todo)
            check_stopped(result)
            if not result.success:
                log(f"!! {label} failed (run {result.run_id}); its log is in the UI (`eagle3 ui`)")
                return False
        skipped.extend(str(u) for u in units if str(u) not in ran and str(u) not in skipped)
        return True

    def in_ranges(job: str, asset: str, keys: list[str], ready: list[str]) -> list[str]:
        """`asset` (one run over a range of shards: the generations, the hidden states) of the `ready` shards that
        need it, one run per contiguous range of `keys` (a run's range cannot skip a shard);
        returns the shards that failed."""
        units = [Unit(asset, k) for k in ready if selection.wants(Unit(asset, k))]
        todo = {u.partition: r for u in units if (r := planner.reason(u))}
        skipped.extend(str(u) for u in units if u.partition not in todo)
        failed = []
        for group in _ranges(keys, todo):
            check_stopped()
            for k in group:
                log(f"-> {asset}[{k}]: {todo[k]}")
            planner.forced.update(Unit(asset, k) for k in group)
            one = len(group) == 1
            result = defs.resolve_job_def(job).execute_in_process(
                instance=instance,
                partition_key=group[0] if one else None,
                tags={**tags, **({} if one else {RANGE_START_TAG: group[0], RANGE_END_TAG: group[-1]})},
                raise_on_error=False,
                run_config={"loggers": {"console": {"config": {"log_level": "INFO"}}}},
            )
            ran.extend(f"{asset}[{k}]" for k in group)
            check_stopped(result)
            if not result.success:
                bad = {e.partition for e in result.get_asset_check_evaluations() if not e.passed}
                lost = [k for k in group if k in bad or not planner.materialized_by(Unit(asset, k), result.run_id)]
                log(f"!! {asset}[{group[0]}{'..' + group[-1] if not one else ''}] failed for {lost} "
                    f"(run {result.run_id}); its log is in the UI (`eagle3 ui`)")
                failed += lost
        return failed

    # The graph's order, each job's consecutive assets one step: what is not partitioned runs
    # once, and waits for every shard before it; a partitioned asset runs per shard (a run each),
    # or per contiguous range of shards when it runs ranges in one run (its backfill policy).
    # A failed shard is named and the other shards go on; nothing that reads every shard runs.
    stages: list[tuple[str, list[str]]] = []
    for name in order:
        partitioned = graph.get(AssetKey(name)).partitions_def is not None
        if stages and stages[-1][0] == job_of[name] and not partitioned \
                and graph.get(AssetKey(stages[-1][1][-1])).partitions_def is None:
            stages[-1][1].append(name)
        else:
            stages.append((job_of[name], [name]))
    keys: list[str] | None = None
    failed: list[str] = []
    ok = True
    for i, (job, names) in enumerate(stages):
        node = graph.get(AssetKey(names[0]))
        if node.partitions_def is None:
            if failed:  # it reads every shard: not until they are all done
                continue
            ok = step(job, [Unit(a) for a in names])
            if not ok and i < len(stages) - 1:
                return False
            continue
        if keys is None:
            keys = instance.get_dynamic_partitions(node.partitions_def.name)
            unknown = sorted(selection.shards - set(keys))
            if unknown:  # a typo must not select nothing and report "up to date"
                raise ValueError(f"--select: no shard {', '.join(unknown)}; the shards are {', '.join(keys) or 'none yet'}")
        ready = [k for k in keys if k not in failed]
        single_run = node.backfill_policy is not None and node.backfill_policy.max_partitions_per_run is None
        if single_run:
            failed += in_ranges(job, names[0], keys, ready)
        else:
            failed += [k for k in ready if not step(job, [Unit(names[0], k)])]
    if failed:
        log(f"shards failed: {failed}; rerun them with `eagle3 run` (finished samples are kept) or from the UI")
        return False
    if skipped:
        log(f"up to date, skipped: {', '.join(skipped)}")
    if not ran:
        log("nothing to do: every asset is up to date (`eagle3 run --force` redoes them)")
    return ok
