"""Verifications behind the asset checks: plain functions that return (passed, details)."""

from __future__ import annotations

import random
from pathlib import Path

import polars as pl
import torch

from .files import TMP_SUFFIX, bytes_on_disk
from .sample_files import (
    MANIFEST,
    SampleLayout,
    checksum_problem,
    read_sample_slices,
    sample_file,
    validate_sample,
    verify_checksums,
)


def verify_shard(shard_dir: Path, generations_path: Path, layout: SampleLayout, spot_checks: int = 4):
    """A shard is complete (files = rows, manifest, no temporaries), every file is a sample of
    `layout` (fp8 scales finite and positive), its bytes agree with the prediction from tokens
    and the layout, and a sample of its files decodes finite and well-formed."""
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
    invalid = [r for r in rows if r not in missing and not validate_sample(sample_file(shard_dir, r), None, layout)]
    if invalid:
        problems.append(f"{len(invalid)} sample files unreadable, damaged (fp8 scales zero or not finite) or not of "
                        f"layout {layout.name}, e.g. rows {invalid[:5]}")
    tokens = sum(len(v) for v in ids_by_row.values())
    expected = tokens * layout.bytes_per_token()
    on_disk = bytes_on_disk(shard_dir)
    slack = layout.predict_bytes(tokens, len(rows)) - expected + (manifest.stat().st_size if manifest.is_file() else 0)
    if not missing and not expected <= on_disk <= expected + slack:
        problems.append(f"bytes on disk {on_disk:,} disagree with the prediction {expected:,} (+ at most {slack:,} of headers)")
    checked = []
    readable = [r for r in rows if r not in missing and r not in invalid]
    for r in random.Random(0).sample(readable, min(spot_checks, len(readable))):
        path = sample_file(shard_dir, r)
        # A rerun keeps files whose header, shapes and scales are sound without reading every
        # value, so a file damaged inside its data must be deleted to be redone.
        found = _sample_problems(path, ids_by_row[r], layout)
        checksum = checksum_problem(path)
        problems.extend(f"row {r}: {p} ({path.name}: delete it and rerun the partition)"
                        for p in found + ([f"checksum: {checksum}"] if checksum else []))
        checked.append(r)
    details = {
        "problems": problems,
        "samples": len(rows) - len(missing),
        "rows": len(rows),
        "layout": layout.name,
        "bytes_per_token": layout.bytes_per_token(),
        "bytes_on_disk": on_disk,
        "bytes_expected": expected,
        "spot_checked_rows": checked,
    }
    return not problems, details


def _sample_problems(path: Path, input_ids: list[int], layout: SampleLayout) -> list[str]:
    """What is wrong with the decoded contents of one file (fp8 NaN codes, top-k out of range...)."""
    t = read_sample_slices(path)  # fp8 decoded: a NaN code or a bad scale shows as non-finite
    problems = []
    for key in ("aux_hidden_states", "last_hidden_state", "topk_logprobs"):
        if key in t and not torch.isfinite(t[key].float()).all():
            problems.append(f"{key} has NaN or Inf")
    if t["input_ids"].tolist() != list(input_ids) or t["aux_hidden_states"].shape != (len(input_ids), 3 * layout.hidden_size):
        problems.append("contents do not match its generation")
    if layout.teacher == "topk":
        ids, logprobs = t["topk_ids"].to(torch.int64), t["topk_logprobs"].float()
        # the vocab map's fingerprint starts with its size (`vocab.vocab_map_fingerprint`)
        size = int(layout.draft_vocab.split("-")[0]) if layout.draft_vocab else None
        if size is not None and ids.numel() and int(ids.max()) >= size:
            problems.append(f"topk_ids reach {int(ids.max())}, beyond the draft vocabulary of {size}")
        if (logprobs > 1e-3).any() or (logprobs.exp().sum(-1) > 1.01).any():
            problems.append("topk_logprobs are not log-probabilities (above 0, or summing above 1)")
        if t["target_in_draft"].numel() and int(t["target_in_draft"].max()) > 1:
            problems.append("target_in_draft holds values other than 0 and 1")
    return problems


def verify_all(hidden_states_root: Path, delete: bool = False) -> dict[str, list[tuple[str, str]]]:
    """Every shard folder under `hidden_states_root` at full strength (`verify_checksums`: each
    sample file read whole against its size and checksums): shard -> [(file, problem)]. With
    `delete`, the damaged sample files are removed, so the next `eagle3 run` re-extracts them."""
    out = {}
    shard_dirs = sorted(d for d in hidden_states_root.iterdir() if d.is_dir()) if hidden_states_root.is_dir() else []
    for shard_dir in shard_dirs:
        out[shard_dir.name] = bad = verify_checksums(shard_dir)
        if delete:
            for name, _ in bad:
                if name != MANIFEST:
                    (shard_dir / name).unlink(missing_ok=True)
    return out
