"""Ingest: read every configured source, streaming, into one file of canonical records.

Sources are JSONL, JSON arrays, CSV/TSV, Parquet, plain text (a document per line, or per file),
folders written by `datasets.save_to_disk`, and datasets read by `datasets.load_dataset`. Every
record keeps its source and line (or row) number; a row that cannot be read is not dropped but
written to `rejected.jsonl` with its code and a message, for the quarantine. Whatever the bytes,
every row ends in exactly one of the two files.
"""

from __future__ import annotations

import csv
import glob
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llmops.core import keys, workspace
from llmops.core.config import DataConfig, PipelineConfig, RecordKind, SourceConfig
from llmops.core.rejects import Reject, RejectCode, json_kind, sorted_counts
from llmops.core.workspace import Figures, StageRecord
from llmops.objectives import preference, seq2seq, token_classification

FIELDS: dict[str, tuple[str, ...]] = {
    "text": ("text",),
    "instruction": ("instruction", "input", "output"),
    "chat": ("messages",),
    "classification": ("text", "label"),
    "tokens": ("tokens", "tags"),
    "preference": preference.FIELDS,
    "seq2seq": ("source", "target"),
}
# the column names public datasets use for a canonical field, tried in order when data.columns does not map it
# (a field without an entry is read from the column of its own name)
COMMON_COLUMNS: dict[str, dict[str, tuple[str, ...]]] = {
    "chat": {"messages": ("messages", "conversations")},
    "seq2seq": {"source": seq2seq.SOURCE_COLUMNS, "target": seq2seq.TARGET_COLUMNS},
    "tokens": {"tokens": token_classification.TOKEN_COLUMNS, "tags": token_classification.TAG_COLUMNS},
    "preference": preference.COLUMN_NAMES,
}
SUFFIX_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".csv": "csv", ".tsv": "tsv",
                  ".parquet": "parquet", ".txt": "text"}
# ShareGPT-style turns: {"from": "human", "value": "..."}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "bot": "assistant",
                  "model": "assistant", "system": "system"}
EXCERPT_CHARS = 200
READ_BLOCK = 1 << 20
# deeper JSON than any record needs; far deeper would exhaust Python's stack when written back
MAX_DEPTH = 64
# the types a JSON value can hold; anything else (bytes, dates from Parquet) is rejected, not stringified
JSON_TYPES = (str, int, float, bool, type(None), list, tuple, dict)

# (line, the row, or why it was rejected)
Row = tuple[int, dict[str, Any] | None, Reject | None]


class DataSourceError(FileNotFoundError):
    """The configured data cannot be found or read."""


class IngestFigures(Figures):
    rows_read: int
    rows_rejected: int
    # keyed by source file: kept out of metric names
    rows_per_source: dict[str, int]
    # keyed by reject code: logged as metrics `ingest.reject_codes.<code>`
    reject_codes: dict[RejectCode, int]
    sources_not_read_to_the_end: int
    # the files that broke partway (a broken JSON array, a Parquet file that stops decoding)
    unread_sources: list[str]
    data_sha256: str

    NAMED_MAPS = ("reject_codes",)


IngestRecord = StageRecord[IngestFigures]


def ingest(config: PipelineConfig, root: Path | None = None) -> IngestRecord:
    """Read the sources; relative paths are relative to `root` (the project)."""
    root = root or workspace.project_root()
    located = locate_all(config.data, root)
    prints = fingerprints(located, root)  # hashing the data once: it may be large
    key = keys.stage_key("ingest", config, {}, {"sources": prints})

    def build(folder: Path) -> IngestFigures:
        stats = write_records(located, config.data, folder, root)
        return IngestFigures(**stats, data_sha256=workspace.hash_json(prints))

    return workspace.build_artifact(IngestRecord, "ingest", key, build)


def locate_all(data: DataConfig, root: Path) -> list[tuple[SourceConfig, str, list[Path]]]:
    sources = [(source, "train") for source in data.sources] + [(s, "eval") for s in data.eval_sources]
    return [(source, split, locate(source, root)) for source, split in sources]


def fingerprints(located: list[tuple[SourceConfig, str, list[Path]]], root: Path) -> list[dict[str, Any]]:
    return [source_fingerprint_of(source, files, root) for source, _, files in located]


def input_fingerprints(config: PipelineConfig, root: Path) -> dict[str, Any]:
    """What ingest reads besides its config: every source file's content."""
    return {"sources": fingerprints(locate_all(config.data, root), root)}


def locate(source: SourceConfig, root: Path) -> list[Path]:
    """The files of a file source; for `name` sources, the files of a local dataset folder (else none)."""
    if source.name is not None:
        local = Path(source.name) if Path(source.name).is_absolute() else root / source.name
        return sorted(p for p in local.rglob("*") if p.is_file()) if local.is_dir() else []
    base = Path(source.path) if Path(source.path).is_absolute() else root / source.path
    if base.is_file():
        return [base]
    if base.is_dir():
        if is_saved_dataset(base):
            return sorted(p for p in base.rglob("*") if p.is_file())
        found = sorted(p for p in base.rglob("*") if p.suffix.lower() in SUFFIX_FORMATS)
    else:
        found = sorted(Path(p) for p in glob.glob(str(base), recursive=True) if Path(p).is_file())
    if not found:
        raise DataSourceError(f"data source {source.path!r}: no data file found at {base}")
    return found


def is_saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_info.json").is_file() or (folder / "dataset_dict.json").is_file()


def source_fingerprint_of(source: SourceConfig, files: list[Path], root: Path) -> dict[str, Any]:
    """What the artifact depends on: file contents, or for a hub dataset, a token that forces a fresh read."""
    if files:
        return {display_name(path, root): workspace.hash_file_cached(path) for path in files}
    # a hub dataset is known by its coordinates: pin `revision` for a version that cannot move
    return {"hub": source.name, "subset": source.subset, "split": source.split, "revision": source.revision}


def source_fingerprint(config: DataConfig, root: Path) -> str:
    """One hash of the configured data, as ingest records it in `data_sha256`."""
    return workspace.hash_json(fingerprints(locate_all(config, root), root))


def display_name(path: Path, root: Path) -> str:
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def write_records(located: list[tuple[SourceConfig, str, list[Path]]], config: DataConfig, folder: Path,
                  root: Path) -> dict[str, Any]:
    """Every row read goes to exactly one of records.jsonl and rejected.jsonl."""
    per_source: Counter[str] = Counter()
    codes: Counter[RejectCode] = Counter()
    unread: list[str] = []
    with (folder / "records.jsonl").open("w", encoding="utf-8") as out, \
         (folder / "rejected.jsonl").open("w", encoding="utf-8") as bad:
        for source, split, files in located:
            for name, line, row, reject in read_source(source, files, config, root):
                per_source[name] += 1
                text = None
                if reject is None:
                    text, reject = record_line(row or {}, config, source, (name, line, split))
                if reject is None:
                    out.write(text + "\n")
                    continue
                codes[reject.code] += 1
                if reject.stops_file:
                    unread.append(name)
                bad.write(json.dumps(reject.entry(name, line), ensure_ascii=False) + "\n")
    return {"rows_read": sum(per_source.values()), "rows_rejected": sum(codes.values()),
            "rows_per_source": dict(per_source), "reject_codes": sorted_counts(codes),
            "sources_not_read_to_the_end": len(unread), "unread_sources": unread}


def record_line(row: dict[str, Any], config: DataConfig, source: SourceConfig,
                origin: tuple[str, int, str]) -> tuple[str | None, Reject | None]:
    """The canonical record as a JSON line, or why it cannot be one."""
    record = canonical(row, config.kind, source.columns)
    reject = foreign_value(record)
    if reject is not None:
        return None, reject
    text = json.dumps(record, ensure_ascii=False)
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:  # e.g. a lone "\\ud83d" escape: not encodable as UTF-8
        return None, Reject(RejectCode.UTF8_INVALID, "an unpaired surrogate escape (e.g. \\ud83d), which is not "
                            "text UTF-8 can hold", excerpt=excerpt(text))
    if size > config.max_record_bytes:
        return None, Reject(RejectCode.TOO_LARGE, too_large(size, config.max_record_bytes), excerpt=excerpt(text))
    name, line, split = origin
    record.update(_source=name, _line=line, _weight=source.weight, _split=split)
    return json.dumps(record, ensure_ascii=False), None


def foreign_value(record: dict[str, Any]) -> Reject | None:
    """A field holding what JSON cannot (bytes, a date from Parquet), or nested absurdly deep; walked without
    recursion, so that no value can exhaust the stack."""
    for field, value in record.items():
        if value is None or isinstance(value, str):  # the common case
            continue
        pending = [(value, 1)]
        while pending:
            item, depth = pending.pop()
            if depth > MAX_DEPTH:
                return Reject(RejectCode.TOO_DEEP, f"{field}: nested more than {MAX_DEPTH} levels deep", field)
            if not isinstance(item, JSON_TYPES) or (isinstance(item, dict) and not all(
                    isinstance(key, str) for key in item)):
                return Reject(RejectCode.WRONG_TYPE, f"{field}: holds a {type(item).__name__} value, which is not "
                              "JSON; convert it to text", field, excerpt(repr(item)))
            if isinstance(item, dict):
                pending.extend((child, depth + 1) for child in item.values())
            elif isinstance(item, list | tuple):
                pending.extend((child, depth + 1) for child in item)
    return None


def too_large(size: int, limit: int) -> str:
    return f"record is {size:,} bytes, over data.max_record_bytes ({limit:,})"


# ends the message of a reject after which the rest of its file could not be read
UNREAD = "; the rest of the file was not read"


def excerpt(text: str) -> str:
    """The start of a row, always writable as UTF-8 (bad bytes and lone surrogates become U+FFFD)."""
    head = text[:EXCERPT_CHARS]
    return head.encode("utf-8", "replace").decode("utf-8") if has_surrogates(head) else head


def read_source(source: SourceConfig, files: list[Path], config: DataConfig,
                root: Path) -> Iterator[tuple[str, int, dict[str, Any] | None, Reject | None]]:
    if source.name is not None or is_saved_dataset_files(files):
        name = source.name or source.path or ""
        for line, row, reject in read_dataset(source, root):
            yield name, line, row, reject
        return
    for path in files:
        fmt = source_format(path, source.format)
        name = display_name(path, root)
        for line, row, reject in READERS[fmt](path, config.max_record_bytes):
            yield name, line, row, reject


def is_saved_dataset_files(files: list[Path]) -> bool:
    return any(p.name in ("dataset_info.json", "dataset_dict.json") for p in files)


def source_format(path: Path, configured: str) -> str:
    if configured not in ("auto", "hub", "arrow"):
        return configured
    fmt = SUFFIX_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise DataSourceError(f"{path}: cannot tell the format from the suffix; set the source's format")
    return fmt


def canonical(row: dict[str, Any], kind: RecordKind, columns: dict[str, str]) -> dict[str, Any]:
    """The record's canonical fields: each from its mapped column, else from the first of its common column names
    that holds a value; values are kept as they are."""
    common = COMMON_COLUMNS.get(kind, {})
    record = {field: row.get(columns[field]) if field in columns else
              next((row[name] for name in common.get(field, (field,)) if row.get(name) is not None), None)
              for field in FIELDS[kind]}
    if kind == "chat" and isinstance(record["messages"], list):
        record["messages"] = [sharegpt_turn(turn) for turn in record["messages"]]
    return record


def sharegpt_turn(turn: Any) -> Any:
    """{"from": "human", "value": ...} becomes {"role": "user", "content": ...}; other turns stay as they are."""
    if isinstance(turn, dict) and "from" in turn and "value" in turn and "role" not in turn:
        return {"role": SHAREGPT_ROLES.get(str(turn["from"]).lower(), turn["from"]), "content": turn["value"]}
    return turn


BOM = b"\xef\xbb\xbf"


def split_lines(handle: Any, limit: int) -> Iterator[tuple[bytes, int]]:
    """Each line's bytes without its end (\\n, \\r\\n or a lone \\r) and its size. A line over `limit` bytes
    is never held whole: only its first `limit + 1` bytes come back, with the full size."""
    head, size, first = b"", 0, True
    while block := handle.read(READ_BLOCK):
        if first:
            block, first = block.removeprefix(BOM), False
        if block.endswith(b"\r"):  # a \r\n split across two blocks is one line end
            block += handle.read(1)
        for piece in block.splitlines(keepends=True):
            body = piece.rstrip(b"\r\n")
            if size == 0 and len(body) <= limit:
                head = body
            elif len(head) <= limit:
                head += body[: limit + 1 - len(head)]
            size += len(body)
            if len(body) < len(piece):  # the piece ends its line
                yield head, size
                head, size = b"", 0
    if size:
        yield head, size


def read_lines(path: Path, max_bytes: int) -> Iterator[tuple[int, bytes | None, Reject | None]]:
    """Numbered lines as bytes, without their line ends and the file's byte-order mark; a line longer than
    `max_bytes` yields None and its reject."""
    with path.open("rb") as handle:
        for number, (raw, size) in enumerate(split_lines(handle, max_bytes), start=1):
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


def read_jsonl(path: Path, max_bytes: int) -> Iterator[Row]:
    """One JSON object per line; lines are read as bytes so that bad bytes cost one row, not the file."""
    for number, raw, reject in read_lines(path, max_bytes):
        if raw is not None and not raw.strip():
            continue
        text, reject = decode(raw) if raw is not None else (None, reject)
        if text is None:
            yield number, None, reject
            continue
        yield number, *parse_object(text)


def parse_object(text: str) -> tuple[dict[str, Any] | None, Reject | None]:
    try:
        # control characters inside strings are kept: validation names the field that holds them
        value = json.loads(text, strict=False)
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
    with path.open("rb") as handle:
        head = handle.read(64).removeprefix(BOM).lstrip()
    yield from (read_json_array if head.startswith(b"[") else read_jsonl)(path, max_bytes)


def read_json_array(path: Path, max_bytes: int) -> Iterator[Row]:
    """Elements are decoded one at a time from a sliding buffer; each keeps the line it starts on.

    A broken element cannot be skipped reliably (where the next one starts is unknown), so it ends
    the read; its reject says so and validation stops the run rather than train on part of the file.
    """
    decoder = json.JSONDecoder(strict=False)
    with path.open("r", encoding="utf-8-sig", errors="surrogateescape") as handle:
        buffer = handle.read(READ_BLOCK)
        position = buffer.index("[") + 1
        line = 1 + buffer[:position].count("\n")
        at_end = False
        while True:
            while position < len(buffer) and (buffer[position].isspace() or buffer[position] == ","):
                line += buffer[position] == "\n"
                position += 1
            if position == len(buffer) or position > READ_BLOCK:
                buffer, position = buffer[position:], 0
                more = handle.read(READ_BLOCK)
                at_end = not more
                if not buffer and at_end:
                    yield line, None, Reject(RejectCode.ARRAY_UNCLOSED, "the JSON array is not closed" + UNREAD,
                                             stops_file=True)
                    return
                buffer += more
                continue
            if buffer[position] == "]":
                return
            try:
                value, end = decoder.raw_decode(buffer, position)
            except json.JSONDecodeError as err:
                size = len(buffer) - position
                ran_out = err.pos >= len(buffer) - 1
                if ran_out and not at_end and size <= max_bytes:
                    more = handle.read(READ_BLOCK)
                    at_end = not more
                    buffer, position = buffer[position:] + more, 0
                    continue
                yield line, None, broken_element(err.msg, size if ran_out and size > max_bytes else 0, max_bytes,
                                                 buffer[position:position + EXCERPT_CHARS])
                return
            except (RecursionError, ValueError) as err:  # nested too deeply; an integer of 4300+ digits
                problem = "nested too deeply" if isinstance(err, RecursionError) else str(err).split(":")[0]
                yield line, None, broken_element(problem, 0, max_bytes, buffer[position:position + EXCERPT_CHARS])
                return
            text = buffer[position:end]
            yield line, *array_element(value, text)
            line += text.count("\n")
            position = end


def broken_element(problem: str, size: int, max_bytes: int, head: str) -> Reject:
    if size:
        return Reject(RejectCode.TOO_LARGE, too_large(size, max_bytes) + UNREAD, excerpt=excerpt(head),
                      stops_file=True)
    return Reject(RejectCode.JSON_BROKEN, f"not valid JSON: {problem}" + UNREAD, excerpt=excerpt(head),
                  stops_file=True)


def array_element(value: Any, text: str) -> tuple[dict[str, Any] | None, Reject | None]:
    if has_surrogates(text):
        return None, Reject(RejectCode.UTF8_INVALID, "invalid UTF-8",
                            excerpt=excerpt(text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")))
    if not isinstance(value, dict):
        return None, Reject(RejectCode.NOT_OBJECT, f"a JSON {json_kind(value)} where an object is expected",
                            excerpt=excerpt(text))
    return value, None


def read_csv(path: Path, max_bytes: int, delimiter: str = ",") -> Iterator[Row]:
    """CSV with a header row; row numbers are the file's line numbers (the header is the first line with text)."""
    csv.field_size_limit(max_bytes)
    with path.open("r", encoding="utf-8-sig", errors="surrogateescape", newline="") as handle:
        reader = csv.reader(handle, delimiter=delimiter)
        header: list[str] = []
        while not header:
            try:
                header = next(reader)
            except StopIteration:
                return
            except csv.Error as err:
                yield reader.line_num, None, Reject(RejectCode.CSV_BROKEN, f"the header row cannot be read ({err})"
                                                    + UNREAD, stops_file=True)
                return
        while True:
            start = reader.line_num + 1
            try:
                row = next(reader)
            except StopIteration:
                return
            except csv.Error as err:
                yield start, None, Reject(RejectCode.CSV_BROKEN, f"unreadable CSV row ({err})")
                continue
            if row:  # a blank line is not a row
                yield start, *csv_record(header, row, delimiter)


def csv_record(header: list[str], row: list[str], delimiter: str) -> tuple[dict[str, Any] | None, Reject | None]:
    text = delimiter.join(row)
    if any(has_surrogates(value) for value in row):
        return None, Reject(RejectCode.UTF8_INVALID, "invalid UTF-8", excerpt=excerpt(text))
    if len(row) != len(header):
        return None, Reject(RejectCode.FIELDS_MISMATCH, f"{len(row)} fields where the header has {len(header)}",
                            excerpt=excerpt(text))
    return dict(zip(header, row, strict=True)), None


def read_tsv(path: Path, max_bytes: int) -> Iterator[Row]:
    yield from read_csv(path, max_bytes, delimiter="\t")


def has_surrogates(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def read_parquet(path: Path, max_bytes: int, batch_rows: int = 10_000) -> Iterator[Row]:
    """Parquet in record batches, so memory stays bounded; row numbers count from 1. A file that cannot be
    opened is a source error; one that breaks partway ends in a reject at the break."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=batch_rows)
    except (pa.ArrowException, OSError, ValueError) as err:
        raise DataSourceError(f"{path}: not a readable Parquet file ({first_line(err)})") from None
    number = 0
    try:
        for batch in batches:
            for row in batch.to_pylist():
                number += 1
                yield number, row, None
    except (pa.ArrowException, OSError, ValueError) as err:
        yield number + 1, None, Reject(RejectCode.FILE_UNREADABLE, f"cannot read the file as Parquet from here "
                                       f"({first_line(err)})" + UNREAD, stops_file=True)


def first_line(err: BaseException) -> str:
    """A library's error, in one line: its type and the first line of its message."""
    message = (str(err).strip().splitlines() or [""])[0][:300]
    return f"{type(err).__name__}: {message}" if message else type(err).__name__


def read_text_lines(path: Path, max_bytes: int) -> Iterator[Row]:
    """Plain text, one document per non-empty line."""
    for number, raw, reject in read_lines(path, max_bytes):
        if raw is not None and not raw.strip():
            continue
        text, reject = decode(raw) if raw is not None else (None, reject)
        yield number, ({"text": text} if text is not None else None), reject


def read_text_file(path: Path, max_bytes: int) -> Iterator[Row]:
    """Plain text, the whole file one document (line 1)."""
    size = path.stat().st_size
    if size > max_bytes:
        with path.open("rb") as handle:
            head = handle.read(EXCERPT_CHARS)
        yield 1, None, Reject(RejectCode.TOO_LARGE, too_large(size, max_bytes),
                              excerpt=excerpt(head.decode("utf-8", "replace")))
        return
    text, reject = decode(path.read_bytes().removeprefix(BOM))
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


READERS = {"jsonl": read_jsonl, "json": read_json, "csv": read_csv, "tsv": read_tsv, "parquet": read_parquet,
           "text": read_text_lines, "text-files": read_text_file}
