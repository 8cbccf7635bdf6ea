"""Verifications behind the asset checks: plain functions that return (passed, details)."""

from __future__ import annotations

import random
from pathlib import Path

import polars as pl
import torch
from safetensors.torch import load_file

from .files import TMP_SUFFIX, bytes_on_disk
from .sample_files import MANIFEST, bytes_per_token, sample_file, validate_sample

HEADER_SLACK_PER_FILE = 1024  # safetensors JSON header + alignment of one sample file


def verify_shard(shard_dir: Path, generations_path: Path, hidden_size: int, dtype: torch.dtype, spot_checks: int = 4):
    """A shard is complete (files = rows, manifest, no temporaries), its bytes agree with the
    prediction from tokens and shapes, and a sample of its files reads back finite and well-shaped."""
    problems: list[str] = []
    gens = pl.read_parquet(generations_path, columns=["row_id", "input_ids"])
    rows = gens["row_id"].to_list()
    manifest = shard_dir / MANIFEST
    if not manifest.is_file():
        problems.append("no manifest (the shard never finished)")
    temporaries = [p.name for p in shard_dir.glob(f".*{TMP_SUFFIX}")] if shard_dir.is_dir() else []
    if temporaries:
        problems.append(f"{len(temporaries)} temporary files left: {temporaries[:3]}")
    missing = [r for r in rows if not sample_file(shard_dir, r).is_file()]
    if missing:
        problems.append(f"{len(missing)} of {len(rows)} sample files missing, e.g. rows {missing[:5]}")
    ids_by_row = dict(zip(rows, gens["input_ids"].to_list()))
    invalid = [r for r in rows if r not in missing and not validate_sample(sample_file(shard_dir, r), None, hidden_size, dtype)]
    if invalid:
        problems.append(f"{len(invalid)} sample files unreadable or of the wrong shape, e.g. rows {invalid[:5]}")
    tokens = sum(len(v) for v in ids_by_row.values())
    expected = tokens * bytes_per_token(hidden_size, dtype)
    on_disk = bytes_on_disk(shard_dir)
    slack = len(rows) * HEADER_SLACK_PER_FILE + (manifest.stat().st_size if manifest.is_file() else 0)
    if not missing and not expected <= on_disk <= expected + slack:
        problems.append(f"bytes on disk {on_disk:,} disagree with the prediction {expected:,} (+ at most {slack:,} of headers)")
    checked = []
    for r in random.Random(0).sample([r for r in rows if r not in missing and r not in invalid], min(spot_checks, len(rows))):
        t = load_file(str(sample_file(shard_dir, r)))
        n = len(ids_by_row[r])
        for key in ("aux_hidden_states", "last_hidden_state"):
            if not torch.isfinite(t[key].float()).all():
                problems.append(f"row {r}: {key} has NaN or Inf")
        if t["input_ids"].tolist() != list(ids_by_row[r]) or t["aux_hidden_states"].shape != (n, 3 * hidden_size):
            problems.append(f"row {r}: contents do not match its generation")
        checked.append(r)
    details = {
        "problems": problems,
        "samples": len(rows) - len(missing),
        "rows": len(rows),
        "bytes_on_disk": on_disk,
        "bytes_expected": expected,
        "spot_checked_rows": checked,
    }
    return not problems, details
