"""Reading data sources as rows, streaming: JSONL, JSON arrays, CSV/TSV, Parquet, plain text and datasets.

Each reader yields (line, row, reject): the row's line (or row) number in its file, the row as a
mapping, or why it could not be read. A row that cannot be read is never dropped: it comes back as a
reject, with a fixed code and a message, for the quarantine. A line over the size limit is never
held whole in memory.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from llmops.config.schema import SourceConfig
from llmops.data.json_array import read_json_array
from llmops.data.rows import (
    DECODER,
    EXCERPT_CHARS,
    READ_BLOCK,
    UNREAD,
    DuplicateKey,
    Row,
    Span,
    excerpt,
    has_surrogates,
    too_large,
)
from llmops.io.compressed import DECOMPRESSION_ERRORS
from llmops.io.errors import UserError
from llmops.io.rejects import Reject, RejectCode, json_kind
from llmops.io.shards import BOM, open_range


class DataSourceError(UserError, FileNotFoundError):
    """The configured data cannot be found or read."""


def split_lines(handle: Any, limit: int, bom: bool = True, lone_cr: bool = True) -> Iterator[tuple[bytes, int]]:
    """Each line's bytes without its end (\\n, \\r\\n, and with `lone_cr` a lone \\r) and its size. A line over
    `limit` bytes is never held whole: only its first `limit + 1` bytes come back, with the full size. `bom`: the
    handle starts at the file's start, where a byte-order mark is not text."""
    head, size, first = b"", 0, bom
    ends = (b"\n", b"\r") if lone_cr else b"\n"
    while block := handle.read(READ_BLOCK):
        if first:
            block, first = block.removeprefix(BOM), False
        if block.endswith(b"\r"):  # a \r\n split across two blocks is one line end
            block += handle.read(1)
        # a binary stream iterates lines ended by \n alone
        for piece in block.splitlines(keepends=True) if lone_cr else io.BytesIO(block):
            ended = piece.endswith(ends)
            body = piece.removesuffix(b"\n").removesuffix(b"\r") if ended else piece
            if size == 0 and len(body) <= limit:
                head = body
            elif len(head) <= limit:
                head += body[: limit + 1 - len(head)]
            size += len(body)
            if ended:
                yield head, size
                head, size = b"", 0
    if size:
        yield head, size


def read_lines(path: Path, max_bytes: int, span: Span | None = None,
               lone_cr: bool = True) -> Iterator[tuple[int, bytes | None, Reject | None]]:
    """Numbered lines as bytes (of the span only, where one is given), without their line ends and the file's
    byte-order mark; a line longer than `max_bytes` yields None and its reject. `lone_cr`: a \\r without a \\n
    ends a line too."""
    start, end, first = span or (0, None, 1)
    with open_range(path, start, end) as handle:
        for number, (raw, size) in enumerate(split_lines(handle, max_bytes, start == 0, lone_cr), start=first):
            if size > max_bytes:
                yield number, None, Reject(RejectCode.TOO_LARGE, too_large(size, max_bytes),
                                           excerpt=excerpt(raw.decode("utf-8", "replace")))
            else:
                yield number, raw, None


def decode(raw: bytes) -> tuple[str | None, Reject | None]:
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError as err:
        return None, Reject(RejectCode.UTF8_INVALID, f"invalid UTF-8 at byte {err.start}",
                            excerpt=excerpt(raw.decode("utf-8", "replace")))


def read_jsonl(path: Path, max_bytes: int, span: Span | None = None) -> Iterator[Row]:
    """One JSON object per line; lines are read as bytes so that bad bytes cost one row, not the file. Only \\n
    ends a line, as JSON Lines says: a lone \\r is whitespace between a record's tokens (or a stray character
    inside one of its strings), not the end of the record."""
    for number, raw, reject in read_lines(path, max_bytes, span, lone_cr=False):
        if raw is not None and not raw.strip():
            continue
        text, reject = decode(raw) if raw is not None else (None, reject)
        if text is None:
            yield number, None, reject
            continue
        yield number, *parse_object(text)


def parse_object(text: str) -> tuple[dict[str, Any] | None, Reject | None]:
    try:
        value = DECODER.decode(text)
    except DuplicateKey as err:
        return None, err.reject(text)
    except json.JSONDecodeError as err:
        return None, Reject(RejectCode.JSON_BROKEN, f"not valid JSON: {err.msg} (column {err.colno})",
                            excerpt=excerpt(text))
    except RecursionError:
        return None, Reject(RejectCode.TOO_DEEP, "JSON nested too deeply to read", excerpt=excerpt(text))
    except ValueError as err:  # e.g. an integer of more than 4300 digits
        return None, Reject(RejectCode.JSON_BROKEN, f"not readable JSON: {str(err).split(':')[0]}",
                            excerpt=excerpt(text))
    if not isinstance(value, dict):
        return None, Reject(RejectCode.NOT_OBJECT, f"a JSON {json_kind(value)} where an object is expected",
                            excerpt=excerpt(text))
    return value, None


def read_json(path: Path, max_bytes: int) -> Iterator[Row]:
    """A JSON array of objects, streamed element by element; a file that is not an array is read as JSONL."""
    yield from (read_json_array if is_json_array(path) else read_jsonl)(path, max_bytes)


def is_json_array(path: Path) -> bool:
    """Whether the file starts as an array does; a compressed file that cannot be read here is read as lines, which
    quarantines what it cannot read."""
    try:
        with open_range(path) as handle:
            head = handle.read(64).removeprefix(BOM)
            while head and not head.strip():  # blank lines before the bracket, however many
                head = handle.read(1 << 16)
            return head.lstrip().startswith(b"[")
    except DECOMPRESSION_ERRORS:
        return False


def read_csv(path: Path, max_bytes: int, delimiter: str = ",") -> Iterator[Row]:
    """CSV with a header row; row numbers are the file's line numbers (the header is the first line with text)."""
    yield from read_csv_part(path, max_bytes, CsvPart(delimiter))


@dataclass
class CsvPart:
    """Which part of a CSV file to read: a span (None: all of it) and the file's header where the span does not
    hold it. Read, it says whether its last row ended inside the span: a quoted field running on past the cut
    means the cut was no row boundary, and the file must be read whole. Unquoted (TSV's way), a quote is text."""

    delimiter: str = ","
    span: Span | None = None
    header: list[str] | None = None
    whole: bool = True
    quoted: bool = True


def csv_reader(lines: Iterator[str], delimiter: str, quoted: bool) -> Any:
    """Strict where fields are quoted: a quote that closes a field before its end (a stray quote that opened a
    "field" running over rows) is an error, not rows run together without a word."""
    if quoted:
        return csv.reader(lines, delimiter=delimiter, strict=True)
    return csv.reader(lines, delimiter=delimiter, quoting=csv.QUOTE_NONE)


def unique_header(header: list[str]) -> list[str]:
    """Column names made unique as pandas and datasets make them (`a`, `a.1`, ...): a repeated name would
    otherwise keep only its last column's values."""
    taken = set(header)
    out: list[str] = []
    for name in header:
        if name in out:
            count = 1
            while f"{name}.{count}" in taken:
                count += 1
            name = f"{name}.{count}"
            taken.add(name)
        out.append(name)
    return out


class CountedLines:
    """A text file's lines for a CSV reader, noting when the reader asked for one past the last; counts the
    lines and, since `mark`, the quotes read (an odd count: a quoted field is still open) and the first
    EXCERPT_CHARS of their text (a row the reader cannot split is shown by it)."""

    def __init__(self, handle: IO[str]) -> None:
        self.handle, self.exhausted = handle, False
        self.count = self.quotes = 0
        self.head = ""

    def __iter__(self) -> CountedLines:
        return self

    def __next__(self) -> str:
        try:
            line = next(self.handle)
        except StopIteration:
            self.exhausted = True
            raise
        self.count += 1
        self.quotes += line.count('"')
        if len(self.head) < EXCERPT_CHARS:
            self.head += line[:EXCERPT_CHARS - len(self.head)]
        return line

    def mark(self) -> None:
        self.quotes, self.head = 0, ""

    def close_quote(self) -> None:
        """Read on to the line where the open quoted field ends (or the span's end)."""
        while self.quotes % 2:
            try:
                next(self)
            except StopIteration:
                return


def open_text(path: Path, span: Span | None) -> IO[str]:
    """A span of a file as text the way the CSV reader reads it: a byte-order mark dropped at the file's start
    only, undecodable bytes kept as surrogates, line ends left to the reader."""
    start, end, _ = span or (0, None, 1)
    return io.TextIOWrapper(open_range(path, start, end), encoding="utf-8-sig" if start == 0 else "utf-8",
                            errors="surrogateescape", newline="")


def csv_header(path: Path, max_bytes: int, delimiter: str, quoted: bool = True) -> tuple[list[str], int] | None:
    """The header of a CSV file and the number of the line it ends on; None when it has none or cannot be read."""
    csv.field_size_limit(max_bytes)
    with open_text(path, None) as handle:
        reader = csv_reader(handle, delimiter, quoted)
        try:
            for row in reader:
                if row:
                    return unique_header(row), reader.line_num
        except (csv.Error, *DECOMPRESSION_ERRORS):
            return None
    return None


def read_csv_part(path: Path, max_bytes: int, part: CsvPart) -> Iterator[Row]:
    csv.field_size_limit(max_bytes)
    # where the span ends before the file does, a row may not run on past it
    cut = part.span is not None and part.span[1] < path.stat().st_size
    base = part.span[2] - 1 if part.span else 0
    with open_text(path, part.span) as handle:
        lines = CountedLines(handle)
        reader = csv_reader(lines, part.delimiter, part.quoted)
        header: list[str] = part.header or []
        while not header:
            try:
                header = unique_header(next(reader))
            except StopIteration:
                return
            except csv.Error as err:
                yield lines.count, None, Reject(RejectCode.CSV_BROKEN, f"the header row cannot be read ({err})"
                                                + UNREAD, excerpt=excerpt(lines.head), stops_file=True)
                return
        while True:
            start = base + lines.count + 1
            lines.mark()
            try:
                row: list[str] | None = next(reader)
            except StopIteration:
                return
            except csv.Error as err:
                row, reject = None, csv_error(err, lines, start, base, max_bytes)
            if cut and lines.exhausted:
                part.whole = False
                return
            if row is None:
                yield start, None, reject
                continue
            if row:  # a blank line is not a row
                yield start, *csv_record(header, row, part.delimiter)


def csv_error(error: csv.Error, lines: CountedLines, start: int, base: int, max_bytes: int) -> Reject:
    """The reject of a row the reader could not split. A field over the limit stops the reader inside it: what
    is left of a quoted one is read past (one reject), not taken for rows of its own."""
    too_long = "field larger than field limit" in str(error)
    if too_long:
        lines.close_quote()
    end = base + lines.count
    where = f"; lines {start}-{end} read as one row" if end > start else ""
    shown = excerpt(lines.head)
    if too_long:
        return Reject(RejectCode.TOO_LARGE, f"a field over data.max_record_bytes ({max_bytes:,}){where}",
                      excerpt=shown)
    return Reject(RejectCode.CSV_BROKEN, f"unreadable CSV row ({error}){where}", excerpt=shown)


def csv_record(header: list[str], row: list[str], delimiter: str) -> tuple[dict[str, Any] | None, Reject | None]:
    text = delimiter.join(row)
    if any(has_surrogates(value) for value in row):
        return None, Reject(RejectCode.UTF8_INVALID, "invalid UTF-8", excerpt=excerpt(text))
    if len(row) != len(header):
        return None, Reject(RejectCode.FIELDS_MISMATCH, f"{len(row)} fields where the header has {len(header)}",
                            excerpt=excerpt(text))
    return dict(zip(header, row, strict=True)), None


def read_tsv(path: Path, max_bytes: int) -> Iterator[Row]:
    yield from read_csv_part(path, max_bytes, CsvPart("\t", quoted=False))


def decompressed(rows: Iterator[Row]) -> Iterator[Row]:
    """A compressed file's rows up to where its bytes cannot be decompressed (damaged, cut short), then one reject
    for the rest of the file. The rows of the last block read before the damage (1 MiB decompressed) go with the
    rest: a decompressor gives nothing of a block it fails in."""
    line = 0
    try:
        for line, row, reject in rows:
            yield line, row, reject
    except DECOMPRESSION_ERRORS as err:
        yield line + 1, None, Reject(RejectCode.FILE_UNREADABLE, f"cannot decompress the file from here "
                                     f"({first_line(err)})" + UNREAD, stops_file=True)


def first_line(err: BaseException) -> str:
    """A library's error, in one line: its type and the first line of its message."""
    message = (str(err).strip().splitlines() or [""])[0][:300]
    return f"{type(err).__name__}: {message}" if message else type(err).__name__


def read_text_lines(path: Path, max_bytes: int, span: Span | None = None) -> Iterator[Row]:
    """Plain text, one document per non-empty line."""
    for number, raw, reject in read_lines(path, max_bytes, span):
        if raw is not None and not raw.strip():
            continue
        text, reject = decode(raw) if raw is not None else (None, reject)
        yield number, ({"text": text} if text is not None else None), reject


def read_text_file(path: Path, max_bytes: int) -> Iterator[Row]:
    """Plain text, the whole file one document (line 1); a file over the limit is never held whole."""
    with open_range(path) as handle:
        head = handle.read(max_bytes + 1)
        size = len(head) + sum(len(block) for block in iter(lambda: handle.read(READ_BLOCK), b""))
    if size > max_bytes:
        yield 1, None, Reject(RejectCode.TOO_LARGE, too_large(size, max_bytes),
                              excerpt=excerpt(head[:EXCERPT_CHARS].decode("utf-8", "replace")))
        return
    text, reject = decode(head.removeprefix(BOM))
    yield 1, ({"text": text} if text is not None else None), reject


def read_dataset(source: SourceConfig, root: Path) -> Iterator[Row]:
    """A save_to_disk folder (memory-mapped) or a load_dataset dataset (streamed); rows count from 1."""
    rows = open_dataset(source, root)
    number = 0
    try:
        for row in rows:
            number += 1
            yield number, dict(row), None
    except Exception as err:  # any decoding failure of a third-party format: the rows so far stand, the rest is refused
        yield number + 1, None, Reject(RejectCode.FILE_UNREADABLE, f"cannot read the dataset from here "
                                       f"({first_line(err)})" + UNREAD, stops_file=True)


def open_dataset(source: SourceConfig, root: Path) -> Any:
    import datasets

    where = source.path or source.name
    try:
        if source.path is not None:
            location = Path(source.path) if Path(source.path).is_absolute() else root / source.path
            loaded = datasets.load_from_disk(str(location))
        else:
            local = root / source.name if source.name and (root / source.name).exists() else None
            return datasets.load_dataset(str(local or source.name), source.subset, split=source.split,
                                         streaming=True, revision=source.revision)
    except Exception as err:  # whatever the library raises for a folder it cannot open: one line that says why
        raise DataSourceError(f"data source {where!r}: cannot be loaded as a dataset ({first_line(err)})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if source.split not in loaded:
            raise DataSourceError(f"data source {source.path!r}: no split {source.split!r} "
                                  f"(it has {', '.join(loaded)})")
        return loaded[source.split]
    return loaded
