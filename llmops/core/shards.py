"""Shards of a line-oriented file: byte ranges that start and end on line boundaries.

A row is known by the byte offset of its line, which the data fixes: whatever the shard size, a
row has the same offset, so anything ordered or keyed by offsets comes out the same however the
file was cut.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path


def byte_ranges(path: Path, shard_bytes: int) -> list[tuple[int, int]]:
    """[start, end) ranges of about `shard_bytes` each, every one holding whole lines; none for an empty file."""
    size = path.stat().st_size
    ranges: list[tuple[int, int]] = []
    start = 0
    with path.open("rb") as handle:
        while start < size:
            handle.seek(min(start + shard_bytes, size))
            handle.readline()  # on to the end of the line the cut falls in
            end = min(handle.tell(), size) if start + shard_bytes < size else size
            ranges.append((start, end))
            start = end
    return ranges


def lines_in(path: Path, start: int, end: int) -> Iterator[tuple[int, bytes]]:
    """(offset, line) for each non-blank line that starts in [start, end)."""
    with path.open("rb") as handle:
        handle.seek(start)
        offset = start
        while offset < end:
            line = handle.readline()
            if not line:
                return
            if line.strip():
                yield offset, line
            offset += len(line)


def shard_of(offsets: list[int], offset: int) -> int:
    """The index of the range (given by its start offsets, ascending) that holds `offset`."""
    from bisect import bisect_right

    return bisect_right(offsets, offset) - 1
