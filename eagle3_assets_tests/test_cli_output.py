"""What a user reads from the CLI: `eagle3 history`, `eagle3 report`, `history --plot`."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def rows() -> list[dict]:
    def row(asset, partition, ts, **metadata):
        return {"asset": asset, "partition": partition, "run_id": "0123456789ab", "timestamp": f"2026-12-0{ts}T00:00:00",
                "metadata": metadata}

    return [
        row("generations", "rows_00000-00048", 1, samples=48, tokens=9_000, tokens_per_s=123.45),
        row("hidden_states", "rows_00000-00048", 2, samples=48, tokens=9_000, tokens_per_s=319_123.4,
            bytes_on_disk=41_517_312, model_load_s=1.25),
        row("hidden_states", "rows_00000-00048", 3, samples=48, tokens=9_000, tokens_per_s=300_000.0,
            bytes_on_disk=41_517_312, model_load_s=1.0),
        row("drafter", None, 4, tokens_per_s=5_555.5),
        row("drafter_eval", None, 5, tau=1.2345),
    ]


def test_history_has_one_meaning_per_column_tau_to_3_decimals_and_separated_bytes():
    from eagle3_assets.cli import history_table

    lines = history_table(rows()).splitlines()
    header = lines[0].split()
    assert "tokens_per_s" not in header and {"answer_tok_s", "extract_tok_s", "train_tok_s"} <= set(header)
    starts = [lines[0].index(h) for h in header] + [None]
    cells = [{h: line[a:b].strip() for h, a, b in zip(header, starts, starts[1:])} for line in lines[1:-1]]
    gen, hs, _, drafter, ev = cells
    assert gen["answer_tok_s"] == "123" and gen["extract_tok_s"] == gen["train_tok_s"] == ""
    assert hs["extract_tok_s"] == "319,123" and hs["bytes_on_disk"] == "41,517,312" and hs["tokens"] == "9,000"
    assert drafter["train_tok_s"] == "5,556"
    assert ev["tau"] == "1.234" or ev["tau"] == "1.235"  # not 1.2
    assert lines[-1] == "5 materializations"


def test_report_prints_the_table_without_polars_shape_or_dtype_rows(tmp_path, monkeypatch, capsys):
    from eagle3_assets import cli

    for f in ("dagster.yaml", "workspace.yaml"):
        shutil.copy(ROOT / f, tmp_path / f)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    monkeypatch.delenv("EAGLE3_SETTINGS", raising=False)
    monkeypatch.setattr(cli, "history", lambda instance: rows())
    assert cli.main(["report"]) == 0
    out = capsys.readouterr().out
    assert "shape:" not in out and " str " not in out and " i64 " not in out and " f64 " not in out
    assert "41,517,312" in out and "319,123.4" in out


def test_history_plot_counts_materializations_in_integer_ticks(tmp_path, monkeypatch):
    import matplotlib.figure

    from eagle3_assets.core.report import plot_history

    saved = []
    original = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda self, *a, **k: (saved.append(self), original(self, *a, **k))[1])
    plot_history(rows(), tmp_path / "h.png")
    ticks = saved[0].axes[1].get_xticks()
    assert len(ticks) and all(float(t).is_integer() for t in ticks), ticks


def test_gitignore_keeps_dagsters_nux_folder_out():
    p = subprocess.run(["git", "check-ignore", "-q", ".nux/nux.yaml"], cwd=ROOT)
    assert p.returncode == 0


# A Dagster asset that runs a Pipes job through `run_job`, as the GPU assets do; run with every
# warning on, the way a user's terminal shows them.
PIPES_SCRIPT = r'''
import sys
from dagster import AssetExecutionContext, PipesSubprocessClient, asset, materialize
import eagle3_assets.definitions  # the code location: its assets, checks and policies

JOB = ("from eagle3_assets.core.vocab import VocabConfig; from eagle3_assets.entrypoints import run_job; "
       "run_job(VocabConfig, lambda p, log: log('the one line of this event'), "
       "lambda pipes, p, r: pipes.report_asset_materialization(metadata={}))")

@asset
def job(context: AssetExecutionContext):
    return PipesSubprocessClient().run(context=context, command=[sys.executable, "-c", JOB],
                                       env={"EAGLE3_JOB_PARAMS": "{}"}).get_materialize_result()

assert materialize([job]).success
'''


def test_a_job_line_prints_once_and_no_opted_in_dagster_warning_shows():
    import os
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-W", "always", "-c", PIPES_SCRIPT], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert out.count("the one line of this event") == 1, out[-3000:]
    assert "PreviewWarning" not in out and "BetaWarning" not in out, out[-3000:]


def test_a_model_load_prints_no_progress_bar_or_expected_load_report(tiny_target, capfd):
    from eagle3_assets.core.target import load_model

    load_model(tiny_target, "float32", "cpu")
    load_model(tiny_target, "float32", "cpu", base_only=True)  # lm_head unused on purpose
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "LOAD REPORT" not in err, err
