"""Shards of a line-oriented file: byte ranges that start and end on line boundaries; of a JSON array: byte ranges
that start where an element does; of a Parquet file: runs of row groups.

A row is known by the byte offset of its line, which the data fixes: whatever the shard size, a
row has the same offset, so anything ordered or keyed by offsets comes out the same however the
file was cut.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from llmops.io.compressed import compression, open_compressed

BOM = b"\xef\xbb\xbf"
BLOCK = 1 << 20


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


# the bytes that move a JSON array's nesting, outside its strings
BRACKET = re.compile(rb"[\[\]{}]")
OPEN_ARRAY, OPEN_OBJECT, BACKSLASH = ord("["), ord("{"), ord("\\")


def array_ranges(path: Path, shard_bytes: int, longest: int, start: int = 0) -> list[tuple[int, int]]:
    """[start, end) ranges of about `shard_bytes` of a file holding a JSON array, each later one starting at an
    object of the array's own; none where the nesting does not add up (the file is then read whole, which finds
    the fault), or where a string runs over `longest` bytes (a record's limit: a reader rejects it anyway).
    `start` > 0: the array's elements start there (just after its bracket), inside a larger document."""
    cuts, depth, done, carry, offset = [start], int(start > 0), False, b"", start
    with path.open("rb") as handle:
        handle.seek(start)
        while not done and (block := handle.read(BLOCK)):
            text, base = carry + block, offset - len(carry)
            offset += len(block)
            carry, depth, done = nest(text, base, depth, cuts, shard_bytes)
            if len(carry) > longest + BLOCK:
                return []
    if carry or not done:
        return []
    return list(zip(cuts, [*cuts[1:], path.stat().st_size], strict=True))


def nest(text: bytes, base: int, depth: int, cuts: list[int], shard_bytes: int) -> tuple[bytes, int, bool]:
    """Follows the nesting through `text` (found at `base`), adding a cut before each of the array's objects that
    lies `shard_bytes` past the last cut; what is left to read again with the next block (a string that goes on
    there), the depth, and whether the array has closed. Strings are skipped quote to quote (a quote after an odd
    run of backslashes is part of one), so that no bracket inside one counts."""
    position, find = 0, text.find
    while True:
        quote = find(b'"', position)
        for mark in BRACKET.finditer(text, position, len(text) if quote < 0 else quote):
            at = mark.start()
            if text[at] in (OPEN_ARRAY, OPEN_OBJECT):
                if depth == 1 and text[at] == OPEN_OBJECT and base + at - cuts[-1] >= shard_bytes:
                    cuts.append(base + at)
                depth += 1
            else:
                depth -= 1
                if depth <= 0:
                    return b"", depth, depth == 0
        if quote < 0:
            return b"", depth, False
        close = string_end(text, quote)
        if close < 0:
            return text[quote:], depth, False
        position = close + 1


# what a search for a top-level key stops at outside strings, and inside one
KEY_STRUCTURE = re.compile(rb'["\[\]{}:]')
IN_STRING = re.compile(rb'["\\]')
QUOTE, COLON, CLOSERS = ord('"'), ord(":"), (ord("]"), ord("}"))


def field_array(path: Path, field: str) -> int | None:
    """Where the elements of the array under the top-level key `field` of a file holding one JSON object start
    (just after its bracket); None where the file is no object, has no such key, or the key holds no array. The
    file is read a block at a time, its strings followed across blocks, however long."""
    scan = KeyScan(field)
    with path.open("rb") as handle:
        offset = 0
        while block := handle.read(BLOCK):
            found = scan.feed(block, offset)
            if found is not None:
                return found if found >= 0 else None
            offset += len(block)
    return None


class KeyScan:
    """The state of a search for a top-level key: nesting, whether inside a string (and after a backslash), the
    text of the current top-level string while it could still be a key, and the key whose value comes next."""

    def __init__(self, field: str) -> None:
        self.field, self.depth, self.in_string, self.escaped = field, 0, False, False
        # a key's text is kept up to the longest way to write the field (every character a \uXXXX escape)
        self.longest = 6 * len(field) + 2
        self.text: bytearray | None = None
        self.said: str | None = None
        self.key: str | None = None

    def feed(self, block: bytes, base: int) -> int | None:
        """The array's start (found at `base` + its index in `block`), -1 where there is none, None: read on."""
        index = 0
        while index < len(block):
            if self.in_string:
                index = self.string_part(block, index)
                continue
            found = KEY_STRUCTURE.search(block, index)
            if found is None:
                return None
            at, byte = found.start(), block[found.start()]
            index = at + 1
            if self.depth == 0 and byte != OPEN_OBJECT:  # no object, or what follows the object's end
                return -1
            if self.depth == 1 and self.key is not None and byte != COLON:  # the value after "key":
                if self.key == self.field:
                    return base + index if byte == OPEN_ARRAY else -1
                self.key = None
            if byte == QUOTE:
                self.in_string, self.text = True, bytearray(b'"') if self.depth == 1 else None
            elif byte == COLON:
                self.key, self.said = (self.said, None) if self.depth == 1 else (self.key, self.said)
            else:
                self.depth += -1 if byte in CLOSERS else 1
                if self.depth == 0:  # the object closed without the key
                    return -1
        return None

    def string_part(self, block: bytes, index: int) -> int:
        """Follows the current string from `index`: to its end, or to the block's end; where it stopped."""
        while index < len(block):
            if self.escaped:
                self.keep(block[index:index + 1])
                self.escaped, index = False, index + 1
                continue
            found = IN_STRING.search(block, index)
            if found is None:
                self.keep(block[index:])
                return len(block)
            stop = found.start()
            self.keep(block[index:stop + 1])
            if block[stop] == BACKSLASH:
                self.escaped, index = True, stop + 1
                continue
            self.in_string = False
            if self.depth == 1:
                self.said = key_text(bytes(self.text)) if self.text is not None else None
            return stop + 1
        return index

    def keep(self, piece: bytes) -> None:
        if self.text is not None:
            self.text += piece
            if len(self.text) > self.longest:  # longer than any way to write the field: not it
                self.text = None


def key_text(quoted: bytes) -> str | None:
    try:
        return json.loads(quoted)
    except ValueError:
        return None


def string_end(text: bytes, quote: int) -> int:
    """Where the string that opens at `quote` closes; -1 where `text` ends first."""
    close = quote
    while True:
        close = text.find(b'"', close + 1)
        if close < 0:
            return -1
        before = close - 1
        while text[before] == BACKSLASH:  # stops at the opening quote at the latest
            before -= 1
        if (close - 1 - before) % 2 == 0:
            return close


def count_lines(path: Path, start: int, end: int, lone_cr: bool = True) -> int:
    """The lines of [start, end) as the line readers number them: ended by \\n, \\r\\n (and with `lone_cr` a lone
    \\r), a last one without an end counted too, a byte-order mark at the file's start not a line of its own."""
    ends, last = line_ends(path, start, end, lone_cr)
    # a last line without its end, where the range holds more than a byte-order mark
    return ends + (last not in (b"", b"\n", b"\r" if lone_cr else b"\n"))


def count_json_lines(path: Path, start: int, end: int) -> int:
    """The lines of [start, end) as the JSON Lines reader numbers them: only \\n ends one."""
    return count_lines(path, start, end, lone_cr=False)


def count_line_ends(path: Path, start: int, end: int) -> int:
    """The line ends (\\n, \\r\\n or a lone \\r) in [start, end): the lines a JSON array's reader moves on by."""
    return line_ends(path, start, end)[0]


def line_ends(path: Path, start: int, end: int, lone_cr: bool = True) -> tuple[int, bytes]:
    """The line ends in [start, end) (a byte-order mark at the file's start skipped; a lone \\r one only with
    `lone_cr`), and the range's last byte."""
    ends = carriage = pairs = 0
    last = b""
    with open_range(path, start, end) as handle:
        if start == 0 and handle.read(len(BOM)) != BOM:
            handle.seek(0)
        while block := handle.read(BLOCK):
            ends += block.count(b"\n")
            if lone_cr:
                carriage += block.count(b"\r")
                pairs += block.count(b"\r\n") + (last == b"\r" and block[:1] == b"\n")
            last = block[-1:]
    return ends + carriage - pairs, last


class RangeFile(io.RawIOBase):
    """The bytes [start, end) of a file, read as if they were all of it."""

    def __init__(self, path: Path, start: int, end: int) -> None:
        self.handle = path.open("rb")
        self.start, self.end = start, end
        self.handle.seek(start)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: self.start, io.SEEK_CUR: self.handle.tell(), io.SEEK_END: self.end}[whence]
        return self.handle.seek(min(max(base + offset, self.start), self.end)) - self.start

    def tell(self) -> int:
        return self.handle.tell() - self.start

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        size = min(len(buffer), self.end - self.handle.tell())
        return self.handle.readinto(memoryview(buffer)[:max(size, 0)])

    def close(self) -> None:
        self.handle.close()
        super().close()


def open_range(path: Path, start: int = 0, end: int | None = None) -> IO[bytes]:
    """A binary reader of [start, end) of the file (end None: to its end); a compressed file only whole, its bytes
    decompressed."""
    codec = compression(path)
    if codec is not None:
        if start or end is not None:
            raise ValueError(f"{path}: a compressed file is read whole, not by byte ranges")
        return open_compressed(path, codec)
    if start == 0 and end is None:
        return path.open("rb")
    return io.BufferedReader(RangeFile(path, start, path.stat().st_size if end is None else end), BLOCK)


def row_group_ranges(path: Path, shard_bytes: int) -> list[tuple[int, int]]:
    """A Parquet file's [first, end) row groups, about `shard_bytes` (compressed) a range; none for a file whose
    footer cannot be read (read whole, it fails as a source does)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except (pa.ArrowException, OSError, ValueError):
        return []
    ranges: list[tuple[int, int]] = []
    start = size = 0
    for group in range(meta.num_row_groups):
        chunk = meta.row_group(group)
        size += sum(chunk.column(column).total_compressed_size for column in range(chunk.num_columns))
        if size >= shard_bytes or group == meta.num_row_groups - 1:
            ranges.append((start, group + 1))
            start, size = group + 1, 0
    return ranges


def row_group_rows(path: Path, start: int, end: int) -> int:
    """The rows of row groups [start, end) of a Parquet file, from its footer."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    return sum(meta.row_group(group).num_rows for group in range(start, end))


def keep_as_parts(files: list[Path], folder: Path, part_bytes: int) -> None:
    """The files' bytes, in order, as the JSON Lines parts of `folder` (made here): a file of half `part_bytes` or
    more moved in as a part of its own, a run of smaller ones joined until it holds that much (or a large file
    comes), empty ones left out. Moving a shard's file costs nothing, where joining every shard copied all of the
    bytes; the parts follow from the files' sizes alone."""
    folder.mkdir()
    half = max(part_bytes // 2, 1)
    parts: list[list[Path]] = []
    run: list[Path] = []
    size = 0
    for path in files:
        length = path.stat().st_size
        if length >= half:
            parts += [run] if size else []
            parts.append([path])
            run, size = [], 0
            continue
        run.append(path)
        size += length
        if size >= half:
            parts.append(run)
            run, size = [], 0
    parts += [run] if size else []
    for number, part in enumerate(parts):
        target = folder / f"part-{number:05d}.jsonl"
        if len(part) == 1:
            os.replace(part[0], target)
        else:
            join_files(part, target)


def kept_parts(folder: Path) -> list[Path]:
    """The parts `keep_as_parts` made, in order."""
    return sorted(folder.glob("part-*.jsonl"), key=lambda path: int(path.stem.removeprefix("part-")))


def join_files(parts: list[Path], target: Path, mode: str = "w") -> None:
    """The parts' bytes, in order, into `target` (mode "a": after what it holds); each part is deleted once copied,
    so that a stage never holds its artifact twice on disk, and what of a part the kernel has not yet written out
    is dropped rather than written."""
    with target.open(mode + "b") as out:
        for part in parts:
            with part.open("rb") as handle:
                shutil.copyfileobj(handle, out)
            part.unlink()
