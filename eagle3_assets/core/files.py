"""Atomic file writes: a file that exists under its final name is complete.

Every writer in the project goes through `atomic_path`: it writes a temporary
name in the same folder and renames it into place, so a killed writer leaves at
most a temporary (removed by `remove_temporaries`), never a truncated file.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

TMP_SUFFIX = ".tmp"


def tmp_name(path: Path) -> Path:
    # The pid keeps two writers of the same file from sharing a temporary.
    return path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path to write; on success it replaces `path` in one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_name(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def atomic_write_parquet(df, path: Path) -> None:
    with atomic_path(path) as tmp:
        df.write_parquet(tmp)


def atomic_write_text(text: str, path: Path) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


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
