"""Shards: the unit of failure and rerun. Keys `rows_00000-02000`, one per `shard_size` rows."""

from __future__ import annotations

import re

KEY = re.compile(r"^rows_(\d{5,})-(\d{5,})$")


class ShardKeyError(ValueError):
    pass


def shard_keys(num_rows: int, shard_size: int) -> list[str]:
    return [shard_key(start, min(start + shard_size, num_rows)) for start in range(0, num_rows, shard_size)]


def shard_key(start: int, end: int) -> str:
    return f"rows_{start:05d}-{end:05d}"


def shard_range(key: str) -> tuple[int, int]:
    """(start, end) row ids of a shard key; end is exclusive."""
    m = KEY.match(key)
    if not m or int(m.group(1)) >= int(m.group(2)):
        raise ShardKeyError(f"{key!r} is not a shard key (expected rows_SSSSS-EEEEE with start < end)")
    return int(m.group(1)), int(m.group(2))
