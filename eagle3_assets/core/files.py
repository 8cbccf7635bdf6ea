"""Atomic file writes: a file that exists under its final name is complete."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import polars as pl

TMP_SUFFIX = ".tmp"


def tmp_name(path: Path) -> Path:
    # The pid keeps two writers of the same file from sharing a temporary.
    return path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")


def atomic_write_parquet(df: pl.DataFrame, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_name(path)
    df.write_parquet(tmp)
    os.replace(tmp, path)


def atomic_write_text(text: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_name(path)
    tmp.write_text(text)
    os.replace(tmp, path)


def remove_temporaries(directory: Path) -> int:
    """Delete leftovers of killed writers; returns how many."""
    n = 0
    if directory.is_dir():
        for p in directory.glob(f".*{TMP_SUFFIX}"):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            n += 1
    return n


def bytes_on_disk(directory: Path) -> int:
    """Sum of the sizes of the files in a directory, measured now."""
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file()) if directory.is_dir() else 0
