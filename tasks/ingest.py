"""Ingest: read every configured source, streaming, into one file of canonical records.

Sources are JSONL, JSON arrays, CSV/TSV, Parquet, plain text (a document per line, or per file),
folders written by `datasets.save_to_disk`, and datasets read by `datasets.load_dataset`. Every
record keeps its source and line (or row) number; a row that cannot be read is not dropped but
written to `rejected.jsonl` with the reason, for the quarantine.
"""

from __future__ import annotations

import csv
import glob
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tasks import keys, workspace
from tasks.config import DataConfig, PipelineConfig, RecordKind, SourceConfig
from tasks.workspace import Figures, StageRecord

FIELDS: dict[str, tuple[str, ...]] = {
    "text": ("text",),
    "instruction": ("instruction", "input", "output"),
    "chat": ("messages",),
    "classification": ("text", "label"),
}
SUFFIX_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".csv": "csv", ".tsv": "tsv",
                  ".parquet": "parquet", ".txt": "text"}
# ShareGPT-style turns: {"from": "human", "value": "..."}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "bot": "assistant",
                  "model": "assistant", "system": "system"}
EXCERPT_CHARS = 200
READ_BLOCK = 1 << 20

Row = tuple[int, dict[str, Any] | None, tuple[str, str] | None]


class DataSourceError(FileNotFoundError):
    """The configured data cannot be found or read."""


class IngestFigures(Figures):
    rows_read: int
    rows_rejected: int
    # keyed by source file: kept out of metric names
    rows_per_source: dict[str, int]
    reject_reasons: dict[str, int]
    sources_not_read_to_the_end: int
    data_sha256: str


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
    per_source: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    read = rejected = unread = 0
    with (folder / "records.jsonl").open("w", encoding="utf-8") as out, \
         (folder / "rejected.jsonl").open("w", encoding="utf-8") as bad:
        for source, split, files in located:
            for name, line, row, problem in read_source(source, files, config, root):
                read += 1
                per_source[name] += 1
                record = None if problem else canonical(row or {}, config.kind, source.columns)
                if record is not None:
                    text = json.dumps(record, ensure_ascii=False, default=str)
                    size = len(text.encode("utf-8", "surrogatepass"))
                    if size > config.max_record_bytes:
                        problem = (too_long(size, config.max_record_bytes), text)
                    elif has_surrogates(text):  # e.g. a lone "\\ud83d" escape: not encodable as UTF-8
                        problem = ("invalid UTF-8 (an unpaired surrogate)", text)
                if problem is not None:
                    rejected += 1
                    reasons[problem[0]] += 1
                    unread += problem[0].endswith(UNREAD)
                    bad.write(json.dumps({"source": name, "line": line, "reason": problem[0],
                                          "excerpt": printable(problem[1][:EXCERPT_CHARS])}, ensure_ascii=False)
                              + "\n")
                    continue
                record.update(_source=name, _line=line, _weight=source.weight, _split=split)
                text = json.dumps(record, ensure_ascii=False, default=str)
                out.write(text + "\n")
    return {"rows_read": read, "rows_rejected": rejected, "rows_per_source": dict(per_source),
            "reject_reasons": dict(reasons), "sources_not_read_to_the_end": unread}


def too_long(size: int, limit: int) -> str:
    return f"record is {size:,} bytes, over data.max_record_bytes ({limit:,})"


# ends the reason of a reject after which the rest of its file could not be read
UNREAD = "; the rest of the file was not read"


def printable(text: str) -> str:
    """An excerpt that can always be written as UTF-8 (bad bytes and lone surrogates become U+FFFD)."""
    return text.encode("utf-8", "replace").decode("utf-8") if has_surrogates(text) else text


def read_source(source: SourceConfig, files: list[Path], config: DataConfig,
                root: Path) -> Iterator[tuple[str, int, dict[str, Any] | None, tuple[str, str] | None]]:
    if source.name is not None or is_saved_dataset_files(files):
        name = source.name or source.path or ""
        for line, row, problem in read_dataset(source, root):
            yield name, line, row, problem
        return
    for path in files:
        fmt = source_format(path, source.format)
        name = display_name(path, root)
        for line, row, problem in READERS[fmt](path, config.max_record_bytes):
            yield name, line, row, problem


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
    """The record's canonical fields, taken from the mapped columns; values are kept as they are."""
    record = {field: row.get(columns.get(field, field)) for field in FIELDS[kind]}
    if kind == "chat" and record["messages"] is None and "conversations" in row and "messages" not in columns:
        record["messages"] = row["conversations"]
    if kind == "chat" and isinstance(record["messages"], list):
        record["messages"] = [sharegpt_turn(turn) for turn in record["messages"]]
    return record


def sharegpt_turn(turn: Any) -> Any:
    """{"from": "human", "value": ...} becomes {"role": "user", "content": ...}; other turns stay as they are."""
    if isinstance(turn, dict) and "from" in turn and "value" in turn and "role" not in turn:
        return {"role": SHAREGPT_ROLES.get(str(turn["from"]).lower(), turn["from"]), "content": turn["value"]}
    return turn


def read_lines(path: Path, max_bytes: int) -> Iterator[tuple[int, bytes | None, tuple[str, str] | None]]:
    """Numbered lines as bytes, without their line ends and the file's byte-order mark.

    A line longer than `max_bytes` is not held in memory: it yields None and the reason.
    """
    with path.open("rb") as handle:
        if handle.read(3) != b"\xef\xbb\xbf":
            handle.seek(0)
        number = 0
        while raw := handle.readline(max_bytes + 3):
            number += 1
            if len(raw.rstrip(b"\r\n")) > max_bytes:
                size = len(raw) + skip_rest_of_line(handle, raw)
                yield number, None, (too_long(size, max_bytes), raw[:EXCERPT_CHARS].decode("utf-8", "replace"))
                continue
            yield number, raw.rstrip(b"\r\n"), None


def skip_rest_of_line(handle: Any, head: bytes) -> int:
    if head.endswith(b"\n"):
        return 0
    skipped = 0
    while block := handle.readline(READ_BLOCK):
        skipped += len(block)
        if block.endswith(b"\n"):
            break
    return skipped


def decode(raw: bytes) -> tuple[str | None, tuple[str, str] | None]:
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError as err:
        return None, (f"invalid UTF-8 at byte {err.start}", raw.decode("utf-8", "replace"))


def read_jsonl(path: Path, max_bytes: int) -> Iterator[Row]:
    """One JSON object per line; lines are read as bytes so that bad bytes cost one row, not the file."""
    for number, raw, problem in read_lines(path, max_bytes):
        if raw is not None and not raw.strip():
            continue
        text, problem = decode(raw) if raw is not None else (None, problem)
        if text is None:
            yield number, None, problem
            continue
        yield number, *parse_object(text)


def parse_object(text: str) -> tuple[dict[str, Any] | None, tuple[str, str] | None]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        return None, (f"broken JSON ({err.msg}, column {err.colno})", text)
    if not isinstance(value, dict):
        return None, (f"not a JSON object but a {type(value).__name__}", text)
    return value, None


def read_json(path: Path, max_bytes: int) -> Iterator[Row]:
    """A JSON array of objects, streamed element by element; a file that is not an array is read as JSONL."""
    with path.open("rb") as handle:
        head = handle.read(64).removeprefix(b"\xef\xbb\xbf").lstrip()
    yield from (read_json_array if head.startswith(b"[") else read_jsonl)(path, max_bytes)


def read_json_array(path: Path, max_bytes: int) -> Iterator[Row]:
    """Elements are decoded one at a time from a sliding buffer; each keeps the line it starts on.

    A broken element cannot be skipped reliably (where the next one starts is unknown), so it ends
    the read; its reject says so and validation stops the run rather than train on part of the file.
    """
    decoder = json.JSONDecoder()
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
                    yield line, None, ("the JSON array is not closed" + UNREAD, "")
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
                reason = too_long(size, max_bytes) if ran_out and size > max_bytes else f"broken JSON ({err.msg})"
                yield line, None, (reason + UNREAD, buffer[position:position + EXCERPT_CHARS])
                return
            text = buffer[position:end]
            yield line, *array_element(value, text)
            line += text.count("\n")
            position = end


def array_element(value: Any, text: str) -> tuple[dict[str, Any] | None, tuple[str, str] | None]:
    if has_surrogates(text):
        return None, ("invalid UTF-8", text.encode("utf-8", "surrogateescape").decode("utf-8", "replace"))
    if not isinstance(value, dict):
        return None, (f"not a JSON object but a {type(value).__name__}", text)
    return value, None


def read_csv(path: Path, max_bytes: int, delimiter: str = ",") -> Iterator[Row]:
    """CSV with a header row; row numbers are the file's line numbers (the header is line 1)."""
    csv.field_size_limit(max_bytes)
    with path.open("r", encoding="utf-8-sig", errors="surrogateescape", newline="") as handle:
        reader = csv.reader(handle, delimiter=delimiter)
        header = next(reader, None)
        while header is not None:
            start = reader.line_num + 1
            try:
                row = next(reader)
            except StopIteration:
                return
            except csv.Error as err:
                yield start, None, (f"unreadable CSV row ({err})", "")
                continue
            if not row:
                continue  # a blank line
            yield start, *csv_record(header, row, delimiter)


def csv_record(header: list[str], row: list[str], delimiter: str) -> tuple[dict[str, Any] | None,
                                                                         tuple[str, str] | None]:
    text = delimiter.join(row)
    if any(has_surrogates(value) for value in row):
        return None, ("invalid UTF-8", text)
    if len(row) != len(header):
        return None, (f"{len(row)} fields, header has {len(header)}", text)
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
    """Parquet in record batches, so memory stays bounded; row numbers count from 1."""
    import pyarrow.parquet as pq

    number = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_rows):
        for row in batch.to_pylist():
            number += 1
            yield number, row, None


def read_text_lines(path: Path, max_bytes: int) -> Iterator[Row]:
    """Plain text, one document per non-empty line."""
    for number, raw, problem in read_lines(path, max_bytes):
        if raw is not None and not raw.strip():
            continue
        text, problem = decode(raw) if raw is not None else (None, problem)
        yield number, ({"text": text} if text is not None else None), problem


def read_text_file(path: Path, max_bytes: int) -> Iterator[Row]:
    """Plain text, the whole file one document (line 1)."""
    size = path.stat().st_size
    if size > max_bytes:
        yield 1, None, (too_long(size, max_bytes), "")
        return
    text, problem = decode(path.read_bytes().removeprefix(b"\xef\xbb\xbf"))
    yield 1, ({"text": text} if text is not None else None), problem


def read_dataset(source: SourceConfig, root: Path) -> Iterator[Row]:
    """A save_to_disk folder (memory-mapped) or a load_dataset dataset (streamed); rows count from 1."""
    import datasets

    if source.path is not None:
        location = Path(source.path) if Path(source.path).is_absolute() else root / source.path
        loaded = datasets.load_from_disk(str(location))
        if isinstance(loaded, datasets.DatasetDict) and source.split not in loaded:
            raise DataSourceError(f"data source {source.path!r}: no split {source.split!r} "
                                  f"(it has {', '.join(loaded)})")
        rows = loaded[source.split] if isinstance(loaded, datasets.DatasetDict) else loaded
    else:
        local = root / source.name if source.name and (root / source.name).exists() else None
        rows = datasets.load_dataset(str(local or source.name), source.subset, split=source.split, streaming=True,
                                     revision=source.revision)
    for number, row in enumerate(rows, start=1):
        yield number, dict(row), None


READERS = {"jsonl": read_jsonl, "json": read_json, "csv": read_csv, "tsv": read_tsv, "parquet": read_parquet,
           "text": read_text_lines, "text-files": read_text_file}
