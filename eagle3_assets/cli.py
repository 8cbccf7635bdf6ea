"""`eagle3`: plan and run the whole graph, open the UI, read the history — on one shared instance.

Every command finds the project root (the folder with dagster.yaml and
workspace.yaml, from the current directory upward) and uses it as DAGSTER_HOME,
so `eagle3 run`, `eagle3 ui` and `eagle3 history` see the same runs without the
user exporting anything.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path


def find_root(start: Path | None = None) -> Path:
    here = (start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / "dagster.yaml").is_file() and (d / "workspace.yaml").is_file():
            return d
    sys.exit(f"eagle3: no project root (a folder with dagster.yaml and workspace.yaml) at or above {here}")


def _enter(args) -> Path:
    root = find_root()
    os.chdir(root)  # dagster.yaml's storage paths are relative to the root
    os.environ.setdefault("DAGSTER_HOME", str(root))
    ensure_instance(Path(os.environ["DAGSTER_HOME"]))
    return root


def _settings_path(args) -> str | None:
    """The command's settings file: --settings, else $EAGLE3_SETTINGS, else ./eagle3.yaml if
    present (None: the embedded demo). Relative to the project root, where `_enter` moved."""
    from .settings import settings_path_from_env

    given = getattr(args, "settings", None)
    return str(Path(given).resolve()) if given else settings_path_from_env()


def _settings(args):
    from .settings import load_settings

    return load_settings(_settings_path(args))


def ensure_instance(dagster_home: Path) -> None:
    """Create the instance's storage once, under a lock, before anything else opens it.

    With SQLite storage each process that opens a fresh instance creates its tables; two at
    once (`eagle3 ui`'s webserver and daemon, and an `eagle3 run`) race and one fails with
    "table ... already exists". The first `eagle3` command creates them here; the others wait
    on the lock, then find them made. (Postgres storage does the same in one transaction.)"""
    import fcntl

    from dagster import DagsterInstance

    lock_dir = dagster_home / ".eagle3"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / "instance.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with DagsterInstance.from_config(str(dagster_home)) as instance:
            instance.get_runs(limit=1)  # run storage
            instance.get_asset_keys()  # event log index
            instance.all_instigator_state()  # schedule storage


def _instance():
    from dagster import DagsterInstance

    return DagsterInstance.get()


# ---------------------------------------------------------------------------------------------
# eagle3 run


def cmd_run(args) -> int:
    from .core import stopping

    # SIGTERM or one Ctrl-C from here on: the jobs save their state, no further step starts.
    stopping.install()
    _enter(args)
    from .definitions import build_definitions
    from .pipeline import AnotherRun, RunStopped, exclusive_run, run_pipeline

    settings = _settings(args)
    defs = build_definitions(settings)
    instance = _instance()
    try:
        with exclusive_run(settings.root):
            ok = run_pipeline(defs, instance, settings, force=args.force, select=args.select,
                              log=lambda m: print(m, flush=True))
    except AnotherRun as e:
        print(f"eagle3 run: {e}", file=sys.stderr)
        return 3
    except RunStopped as e:
        print(f"eagle3 run: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # Everything is recorded (the instance commits each event); the interpreter's teardown of
        # torch and Dagster would only add seconds to a stop that should take few.
        os._exit(e.exit_code)
    except ValueError as e:  # a bad --select
        print(f"eagle3 run: {e}", file=sys.stderr)
        return 2
    print(summary(instance, instance.get_dynamic_partitions("shards")), flush=True)
    return 0 if ok else 1


def _latest(instance, asset: str, partition: str | None = None) -> dict:
    from .records import latest

    record = latest(instance, asset, partition)
    return {k: _raw(v) for k, v in record.asset_materialization.metadata.items()} if record is not None else {}


def summary(instance, keys: list[str]) -> str:
    """The latest figures of every shard and of the drafter, from the instance (what the UI shows)."""
    lines = ["", "eagle3 summary",
             f"{'shard':<18} {'samples':>8} {'answer tok/s':>13} {'tokens':>10} {'extract tok/s':>14} {'bytes on disk':>15}"]
    for k in keys:
        g, m = _latest(instance, "generations", k), _latest(instance, "hidden_states", k)
        lines.append(
            f"{k:<18} {_num(m.get('samples')):>8} {_num(g.get('tokens_per_s')):>13} {_num(m.get('tokens')):>10} "
            f"{_num(m.get('tokens_per_s')):>14} {_num(m.get('bytes_on_disk')):>15}"
        )
    d = _latest(instance, "drafter")
    e = _latest(instance, "drafter_eval")
    lines.append(f"drafter: {d.get('path', '-')}  (steps {d.get('steps', '-')}, final loss {d.get('final_loss', '-')})")
    lines.append(
        f"acceptance length tau: {_cell(e.get('tau'), 3) or '-'} over {e.get('prompts_used', '-')} prompts "
        f"({', '.join(e.get('prompt_sets') or []) or '-'}; K={e.get('num_draft_tokens', '-')}, "
        f"{_speedups(e)})"
    )
    return "\n".join(lines)


def _speedups(e: dict) -> str:
    """"batch 1 speed-up 1.85x, batch 16 slow-down 0.93x" from drafter_eval's metadata."""
    from .core.evaluate import speed_text

    done = [f"batch {b} {speed_text(e[f'speedup_b{b}'])}" for b in e.get("speedup_batches") or []
            if isinstance(e.get(f"speedup_b{b}"), (int, float))]
    return ", ".join(done) or "no speed-up measured"


def _num(x) -> str:
    return f"{x:,.0f}" if isinstance(x, (int, float)) else "-"


def _raw(value):
    """A metadata value as plain JSON data."""
    v = getattr(value, "value", value)
    return v if isinstance(v, (int, float, str, bool, list, dict, type(None))) else str(v)


# ---------------------------------------------------------------------------------------------
# eagle3 history


def history(instance) -> list[dict]:
    from .records import materializations

    out = []
    for key in instance.get_asset_keys():
        for r in materializations(instance, key):
            m = r.asset_materialization
            out.append(
                {
                    "asset": key.to_user_string(),
                    "partition": m.partition,
                    "run_id": r.run_id,
                    "timestamp": datetime.fromtimestamp(r.timestamp, timezone.utc).isoformat(),
                    "metadata": {k: _raw(v) for k, v in m.metadata.items()},
                }
            )
    return sorted(out, key=lambda r: (r["timestamp"], r["asset"], r["partition"] or ""))


def cmd_history(args) -> int:
    _enter(args)
    rows = history(_instance())
    if args.plot:
        from .core.report import plot_history

        print(f"wrote {plot_history(rows, Path(args.plot))}")
        return 0
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(history_table(rows))
    return 0


# `tokens_per_s` means something else in each asset's metadata: a column of its own for each.
RATE_COLUMNS = {"generations": "answer_tok_s", "hidden_states": "extract_tok_s", "drafter": "train_tok_s"}
HISTORY_COLUMNS = ("timestamp", "asset", "partition", "run_id", "samples", "tokens", *RATE_COLUMNS.values(),
                   "bytes_on_disk", "model_load_s", "tau")


def history_table(rows: list[dict]) -> str:
    """`eagle3 history`'s table: one meaning per column, tau to 3 decimals, thousands separated."""
    def cell(r: dict, column: str) -> str:
        if column in RATE_COLUMNS.values():
            value = r["metadata"].get("tokens_per_s") if RATE_COLUMNS.get(r["asset"]) == column else None
            return _cell(value, 0)
        return _cell(r["metadata"].get(column), 3 if column == "tau" else 1)

    table = [[r["timestamp"][:19], r["asset"], r["partition"] or "", r["run_id"][:8]]
             + [cell(r, c) for c in HISTORY_COLUMNS[4:]] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in table)) if table else len(c) for i, c in enumerate(HISTORY_COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(HISTORY_COLUMNS, widths))]
    lines += ["  ".join(v.rjust(w) if i >= 4 else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths))) for row in table]
    lines.append(f"{len(rows)} materializations")
    return "\n".join(lines)


def _cell(v, decimals: int = 1) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:,.{decimals}f}" if isinstance(v, float) else str(v)


def cmd_report(args) -> int:
    _enter(args)
    import polars as pl

    from .core.report import manifests_summary, throughput_report

    settings = _settings(args)

    print_drafters(history(_instance()))
    # The table alone: no shape line, no dtype row; numbers with thousands separators.
    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=200, tbl_hide_dataframe_shape=True,
                   tbl_hide_column_data_types=True, tbl_hide_dtype_separator=True, thousands_separator=","):
        print("throughput_report (every hidden_states materialization in the instance)")
        print(throughput_report(history(_instance())))
    print("\non disk now (manifests):")
    for shard, samples, tokens, nbytes in manifests_summary(settings.root / "hidden_states"):
        print(f"  {shard}: {samples} samples, {tokens:,} tokens, {nbytes:,} bytes of sample files")
    return 0


def print_drafters(rows: list[dict]) -> None:
    """Every drafter_eval materialization compared: tau per set and category, the data, the
    training, and the settings changed since the drafter before (`core/report.py`)."""
    from .core.report import drafter_rows, format_comparison

    print(format_comparison(drafter_rows(rows)))
    print()


# ---------------------------------------------------------------------------------------------
# eagle3 plan


def plan_from_settings(settings, history_rows: list[dict], tokens_per_s: float | None = None, instance=None,
                       quick: bool = False) -> dict:
    """What a run of `settings` will write and take (`core/plan.py`). With `instance`, from what
    `eagle3 run` would do there: the prompts table on disk only if it would keep it (else the one
    these settings build), a shard done only if it would not extract it again. Without one,
    what is on disk counts as current. Times from `history_rows` (same kind of device). `quick`:
    a table to build is built without a tokenizer, each prompt counted at `max_prompt_tokens`."""
    from transformers import AutoConfig

    from .prompt_table import build_table
    from .checks import sample_layout
    from .core import plan
    from .core.evaluate import load_prompt_set
    from .core.layout import Layout
    from .core.self_prompts import SELF_WRITTEN
    from .core.target import pick_device, resolve_target

    model_dir = resolve_target(settings.target_model, settings.model_cache_dir)
    layout = sample_layout(settings, AutoConfig.from_pretrained(model_dir).hidden_size)
    paths = Layout(settings.root)
    pending = None
    if instance is not None:
        from .definitions import build_definitions
        from .pipeline import Planner, Unit

        planner = Planner(build_definitions(settings), instance, settings, force=False)
        pending = lambda asset, shard=None: planner.reason(Unit(asset, shard))  # noqa: E731
    keep_table = paths.prompts.is_file() and (pending is None or pending("prompts") is None)
    quick_table = quick and not keep_table  # --quick changes only a table still to build
    if keep_table:
        built, note = None, f"the table on disk ({paths.prompts})"
        length = None
    else:
        why = "none on disk" if not paths.prompts.is_file() else pending("prompts")
        table, length = build_table(settings, quick=quick)  # generator:self's rows: placeholders
        built = table.rows
        note = (f"the table these settings build ({len(built):,} prompts{', not tokenized (--quick)' if quick else ''}; "
                f"the run rebuilds it: {why})")
    tokenizer = []  # loaded once, when a shard needs it

    def templated(system, prompt) -> int:
        if length is not None:
            return length(system, prompt)
        from .core.generate import template_ids
        from .core.target import load_tokenizer

        tokenizer[:] = tokenizer or [load_tokenizer(model_dir)]
        return len(template_ids(tokenizer[0], system, prompt))

    gen = settings.generation

    def prompt_lengths(rows) -> list[int]:
        """Each row's prompt tokens, an upper bound: with every turn answered, each turn templated
        on its own (the system turn counted each time) and a full answer per earlier turn."""
        if quick_table:
            return [settings.max_prompt_tokens] * len(rows)
        out = []
        all_turns = gen.turns == "all" and "later_turns" in rows.columns
        for row in rows.iter_rows(named=True):
            if row.get("source") == SELF_WRITTEN and not row["prompt"]:  # not written yet: its longest
                n = templated(None, "") + settings.self_prompts.max_tokens
            else:
                n = templated(row["system"], row["prompt"])
            for turn in (row["later_turns"] or []) if all_turns else []:
                n += gen.max_new_tokens + templated(row["system"], turn)
            out.append(min(n, settings.max_prompt_tokens))
        return out

    shards = plan.shard_tokens(paths, settings.shard_size, gen.max_new_tokens, prompt_lengths, built, pending,
                               gen.samples_per_prompt, "prompt_count" if quick_table else "prompt_lengths")
    kinds = {asset: pick_device(section.device).type for asset, section in (
        ("generations", settings.generation), ("hidden_states", settings.extraction),
        ("drafter", settings.training), ("drafter_eval", settings.eval))}
    if tokens_per_s:
        rate = plan.Rate(tokens_per_s, 0.0, f"given: --tokens-per-s {tokens_per_s:,.0f}")
    else:
        rate = plan.measured_rate(history_rows, layout, kinds["hidden_states"])
    extract = [s for s in shards if not _done(s, paths)]
    generate = [s for s in shards if s.source != "generations"]
    train = (bool(extract) or not (paths.drafter / "config.json").is_file()
             or (pending is not None and pending("drafter") is not None))
    evaluate = train or not paths.drafter_eval.is_file() or (pending is not None and pending("drafter_eval") is not None)
    total_tokens = sum(s.tokens for s in shards)
    work = plan.StageWork(
        kinds=kinds,
        generate_samples=sum(s.samples for s in generate),  # 1 + samples_per_prompt per prompt, counted per shard
        generate_shards=len(generate),
        max_new_tokens=settings.generation.max_new_tokens,
        train_tokens=(int(settings.training.max_steps * settings.training.batch_tokens) if settings.training.max_steps
                      else int(settings.training.epochs * total_tokens)) if train else None,
        time_budget_s=settings.training.time_budget_s,
        eval_prompts=sum(len(load_prompt_set(p, settings.eval.num_prompts)) for p in settings.eval.prompt_sets)
        if evaluate else None,
    )
    extraction_s = None if rate is None and extract else sum(
        rate.model_load_s + s.tokens / rate.tokens_per_s for s in extract) if extract else 0.0
    stages = plan.stage_times(history_rows, work, extraction_s,
                              rate.source if rate else f"unknown: no hidden_states materialization on "
                                                       f"{kinds['hidden_states']} in the history")
    result = plan.make_plan(shards, layout, paths.root / "hidden_states", rate, stages)
    result["prompts_table"] = note
    return result


def _done(shard, paths) -> bool:
    from .core.sample_files import MANIFEST

    return (paths.hidden_states(shard.shard) / MANIFEST).is_file() and shard.redo is None


def cmd_plan(args) -> int:
    _enter(args)
    from .core.plan import format_plan

    settings = _settings(args)
    instance = _instance()
    result = plan_from_settings(settings, history(instance), args.tokens_per_s, instance, args.quick)
    if getattr(args, "gpus", None):
        try:
            result["gpu_plan"] = gpu_plan_from_settings(settings, result, args.gpus, args.gpu_memory_gb * 1e9)
        except ValueError as e:  # not an MoE target, or a checkpoint we cannot size
            print(f"eagle3 plan --gpus: {e}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        from .core.plan import format_gpu_plan

        print(format_plan(result) + ("\n" + format_gpu_plan(result["gpu_plan"]) if "gpu_plan" in result else ""))
    return 0


def gpu_plan_from_settings(settings, plan_result: dict, gpus: int, gpu_bytes: float) -> dict:
    """Memory per GPU and the rate of an MoE target over `gpus` GPUs (`core.plan.gpu_plan`), from the
    target's config and the bytes of its checkpoint as stored (INT4, FP8 or bf16)."""
    from transformers import AutoConfig

    from .checks import sample_layout
    from .core import plan
    from .core.quantized import checkpoint_tensor_bytes
    from .core.sample_files import STORAGES, TEACHERS, SampleLayout
    from .core.target import resolve_target

    model_dir = resolve_target(settings.target_model, settings.model_cache_dir)
    config = AutoConfig.from_pretrained(model_dir)
    chosen = sample_layout(settings, config.hidden_size)
    layouts = [SampleLayout(chosen.hidden_size, chosen.dtype, s, t, chosen.topk) for s in STORAGES for t in TEACHERS]
    total = plan_result["total"]
    return plan.gpu_plan(config, checkpoint_tensor_bytes(model_dir), gpus, layouts,
                         total["tokens"] / max(total["samples"], 1), gpu_bytes=gpu_bytes)


# ---------------------------------------------------------------------------------------------
# eagle3 verify


def cmd_verify(args) -> int:
    """Every sample file of every shard read whole against the size and checksums recorded when it
    was written; exit 1 if any is damaged."""
    _enter(args)
    from .core.verify import verify_all

    settings = _settings(args)
    results = verify_all(settings.root / "hidden_states", delete=args.delete)
    for shard, bad in results.items():
        print(f"{shard}: " + ("ok" if not bad else f"{len(bad)} damaged"), flush=True)
        for name, what in bad:
            print(f"  {name}: {what}" + (" (deleted)" if args.delete and name.endswith(".safetensors") else ""))
    damaged = sum(map(len, results.values()))
    if not results:
        print(f"no shards under {settings.root / 'hidden_states'}")
    elif damaged:
        print(f"{damaged} damaged file(s); " + ("`eagle3 run` re-extracts them" if args.delete else
              "`eagle3 verify --delete` removes them, then `eagle3 run` re-extracts them"))
    return 1 if damaged else 0


# ---------------------------------------------------------------------------------------------
# eagle3 ui


UI_GRACE_S = 6.0  # after SIGTERM/SIGINT, for `dagster dev` to stop its services before they are killed


def cmd_ui(args) -> int:
    """`dagster dev` as a child that stops within UI_GRACE_S (plus a little) of SIGTERM or SIGINT.

    Run from a script in the background, a process starts with SIGINT ignored, and `dagster dev`
    maps SIGTERM to its SIGINT handler: it then ignored both, and waits up to 60 s for each service
    when it does stop. Here the handlers below are installed before the child starts (so it starts
    with the default ones), the child gets SIGTERM, and whatever is left of its process group after
    the grace period is killed. The kernel sends it SIGTERM if this process dies."""
    import signal
    import subprocess
    import time

    from .core import stopping

    root = _enter(args)
    path = _settings_path(args)
    _settings(args)  # a bad file fails here, in one line, not in the UI's code location

    received: list[int] = []

    def on_signal(signum, frame) -> None:
        received.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # This interpreter's own Dagster: `.venv/bin/eagle3 ui` works without activating the venv.
    cmd = [sys.executable, "-m", "dagster", "dev", "-w", str(root / "workspace.yaml"), "-p", str(args.port), "-h", args.host]
    # `dagster dev` loads the code location itself (definitions.defs): it reads the file from the environment.
    env = {**os.environ, **({"EAGLE3_SETTINGS": path} if path else {})}
    child = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=stopping.parent_death_signal(parent=os.getpid()))
    deadline = None
    while child.poll() is None:
        if received and deadline is None:
            deadline = time.monotonic() + UI_GRACE_S
            print(f"eagle3 ui: {signal.Signals(received[0]).name}: stopping dagster dev", file=sys.stderr, flush=True)
            _signal_group(child.pid, signal.SIGTERM)
        if deadline is not None and time.monotonic() > deadline:
            break
        time.sleep(0.1)
    _signal_group(child.pid, signal.SIGKILL)  # its webserver, daemon and code servers, whatever is left
    child.wait()
    return 128 + received[0] if received else child.returncode


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="eagle3", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="materialize what is missing or stale (prompts, each shard, vocab map, drafter, eval)")
    r.add_argument("--settings", help="settings YAML (default: ./eagle3.yaml if present, else the embedded demo)")
    r.add_argument("--force", action="store_true", help="redo every selected asset, stale or not")
    r.add_argument("--select", action="append", metavar="ITEMS",
                   help="only these assets and/or shards, comma-separated: e.g. hidden_states, rows_00000-02000, "
                        "hidden_states[rows_00000-02000] (repeatable)")
    r.set_defaults(func=cmd_run)
    pl_ = sub.add_parser("plan", help="before running: per shard samples, tokens, bytes of the file layout, free space, time")
    pl_.add_argument("--settings", help="settings YAML (default: ./eagle3.yaml if present, else the embedded demo)")
    pl_.add_argument("--json", action="store_true")
    pl_.add_argument("--tokens-per-s", type=float, help="extraction rate to plan with (default: the last measured one)")
    pl_.add_argument("--quick", action="store_true",
                     help="a prompts table to build is not tokenized: each prompt counted at max_prompt_tokens (looser)")
    pl_.add_argument("--gpus", type=int, help="an MoE target over this many GPUs: memory per GPU, the pack that fits, a rate")
    pl_.add_argument("--gpu-memory-gb", type=float, default=141.0, help="memory of one GPU (default: an H200's 141 GB)")
    pl_.set_defaults(func=cmd_plan)
    h = sub.add_parser("history", help="every materialization in the instance")
    h.add_argument("--json", action="store_true")
    h.add_argument("--plot", metavar="PATH", help="write a PNG chart of tokens/s and bytes per shard")
    h.set_defaults(func=cmd_history)
    rp = sub.add_parser("report", help="every drafter compared (tau per set and category, data, training, settings "
                                       "changed); throughput per shard: runs, tokens/s (latest, best), bytes")
    rp.add_argument("--settings", help="settings YAML (default: ./eagle3.yaml if present, else the embedded demo)")
    rp.set_defaults(func=cmd_report)
    v = sub.add_parser("verify", help="read every sample file whole against the checksums written with it")
    v.add_argument("--settings", help="settings YAML (default: ./eagle3.yaml if present, else the embedded demo)")
    v.add_argument("--delete", action="store_true", help="remove damaged files: the next `eagle3 run` re-extracts them")
    v.set_defaults(func=cmd_verify)
    u = sub.add_parser("ui", help="the Dagster UI (webserver + daemon) on the same instance")
    u.add_argument("--settings")
    u.add_argument("--port", type=int, default=3000)
    u.add_argument("--host", default="127.0.0.1")
    u.set_defaults(func=cmd_ui)
    args = p.parse_args(argv)
    from .settings import SettingsError

    try:
        return args.func(args)
    except SettingsError as e:  # the user's file is wrong: say how, without a traceback
        print(f"eagle3 {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
