"""Ingest: read every configured source, streaming, into canonical records (the JSON Lines parts of `records/`).

Sources are JSONL, JSON arrays, CSV/TSV, Parquet, plain text (a document per line, or per file),
folders written by `datasets.save_to_disk`, and datasets read by `datasets.load_dataset`
(data/readers.py). Each row is mapped to the fields of the configured record kind (the selected
objective's: objectives/), and keeps its source and line (or row) number; a row that cannot be read
is not dropped but written to `rejected.jsonl` with its code and a message, for the quarantine.
Whatever the bytes, every row ends in exactly one of the two files.

Files are read in shards on the engine: JSONL, JSON that is no array, CSV/TSV and text by byte ranges
on line boundaries (each shard knows the number of its first line, counted shard by shard first),
Parquet by runs of row groups (rows counted from the footer), JSON arrays by byte ranges that start at
one of the array's objects (found by one pass over the file's nesting), text-per-file and datasets a
file or a source per shard. The shards are cut by the input's size alone, and each shard's records
become a part (small ones joined), so the artifact is the same bytes whatever the engine and worker
count; its rejects are joined in order into `rejected.jsonl`. A CSV file whose quoted field spans a
cut, and a JSON array that breaks partway, are read again whole (a Parquet file's damage is its row
groups' own).
"""

from __future__ import annotations

import errno
import glob
import json
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llmops.config.engine import EngineConfig
from llmops.config.schema import DataConfig, PipelineConfig, SourceConfig
from llmops.data.ingest_cuts import (
    SUFFIX_FORMATS,
    IngestJob,
    csv_dialect,
    cut_sources,
    input_shard_size,
    numbered,
    whole,
)
from llmops.data.json_array import read_json_array
from llmops.data.parquet_rows import read_parquet
from llmops.data.readers import (
    CsvPart,
    DataSourceError,
    decompressed,
    excerpt,
    read_csv,
    read_csv_part,
    read_dataset,
    read_json,
    read_jsonl,
    read_text_file,
    read_text_lines,
    read_tsv,
    too_large,
)
from llmops.data.rows import has_surrogates
from llmops.io.compressed import compression, data_suffix
from llmops.io.figures import Figures
from llmops.io.files import hash_json, project_root
from llmops.io.files import read_jsonl as read_written_jsonl
from llmops.io.rejects import CodeName, Reject, RejectCode, sorted_counts
from llmops.io.shards import join_files, keep_as_parts, kept_parts
from llmops.objectives import record_kind
from llmops.pipeline.engine import Engine
from llmops.pipeline.stages import StageContext
from llmops.records.base import RecordKind
from llmops.store.artifacts import StageRecord
from llmops.store.workspace import hash_file_cached

# deeper JSON than any record needs; far deeper would exhaust Python's stack when written back
MAX_DEPTH = 64
# the folder of the artifact that holds the records' parts
RECORDS = "records"
# the types a JSON value can hold; anything else (bytes, dates from Parquet) is rejected, not stringified
JSON_TYPES = (str, int, float, bool, type(None), list, tuple, dict)
# the readers of a span of a file, by the format ingest reads the file as (jsonl for the rest; JSON arrays have a
# reader of their own, told whether the array ends its file)
SPAN_READERS = {"text": read_text_lines, "parquet": read_parquet}
# the readers of whole files, by format
READERS = {"jsonl": read_jsonl, "json": read_json, "csv": read_csv, "tsv": read_tsv, "text": read_text_lines,
           "text-files": read_text_file, "parquet": read_parquet}


class IngestFigures(Figures):
    rows_read: int
    rows_rejected: int
    # keyed by source file: kept out of metric names
    rows_per_source: dict[str, int]
    # keyed by reject code: logged as metrics `ingest.reject_codes.<code>`
    reject_codes: dict[CodeName, int]
    sources_not_read_to_the_end: int
    # the files that broke partway (a broken JSON array, a Parquet file that stops decoding)
    unread_sources: list[str]
    data_sha256: str
    # how the work was spread (None in records made before it was): shard jobs (a cut file's line count and its
    # reading each count), workers, the peak memory of the largest worker
    shards: int | None = None
    workers: int | None = None
    peak_worker_rss_mb: float | None = None

    NAMED_MAPS = ("reject_codes",)


IngestRecord = StageRecord[IngestFigures]


def ingest(config: PipelineConfig, context: StageContext) -> IngestFigures:
    """Read the sources (relative paths are the project's) into the stage's folder, shard by shard on the engine."""
    root = project_root()
    located = locate_all(config.data, root)
    stats = write_records(located, config.data, record_kind(config.data), context.folder, root, config.engine)
    return IngestFigures(**stats, data_sha256=hash_json(fingerprints(located, root)))


def locate_all(data: DataConfig, root: Path) -> list[tuple[SourceConfig, str, list[Path]]]:
    sources = [(source, "train") for source in data.sources] + [(s, "eval") for s in data.eval_sources]
    return [(source, split, locate(source, root)) for source, split in sources]


def fingerprints(located: list[tuple[SourceConfig, str, list[Path]]], root: Path) -> list[dict[str, Any]]:
    return [source_fingerprint_of(source, files, root) for source, _, files in located]


def input_fingerprints(config: PipelineConfig, root: Path) -> dict[str, Any]:
    """What ingest reads besides its config: every source file's content."""
    return {"sources": fingerprints(locate_all(config.data, root), root)}


def locate(source: SourceConfig, root: Path) -> list[Path]:
    """The files of a file source; for `name` sources, the files of a local dataset folder (else none). Each file's
    name must be UTF-8: the records name their file, and a name that is not cannot be written in one."""
    files = source_files(source, root)
    for path in files:
        if has_surrogates(str(path)):
            raise DataSourceError(f"data source {source.path or source.name!r}: the name {os.fsencode(path)!r} is "
                                  "not UTF-8, which the records that name their file need: rename the file")
    return files


def source_files(source: SourceConfig, root: Path) -> list[Path]:
    if source.name is not None:
        local = Path(source.name) if Path(source.name).is_absolute() else root / source.name
        return sorted(p for p in local.rglob("*") if p.is_file()) if local.is_dir() else []
    base = Path(source.path) if Path(source.path).is_absolute() else root / source.path
    if base.is_file():
        return [base]
    if base.is_dir():
        if is_saved_dataset(base):
            return sorted(p for p in listed(base, source) if p.is_file())
        found = regular_files([p for p in listed(base, source) if data_suffix(p) in SUFFIX_FORMATS], base, source)
    else:
        found = regular_files([Path(p) for p in glob.glob(str(base), recursive=True)], glob_base(base), source)
    if not found:
        raise DataSourceError(f"data source {source.path!r}: no data file found at {base}")
    return found


def listed(base: Path, source: SourceConfig) -> list[Path]:
    """Every folder and file under `base` (links to folders not followed). A folder that cannot be listed, at any
    depth, is an error naming it: Path.rglob passes over one without a word, and its files would be lost."""

    def refuse(err: OSError) -> None:
        raise DataSourceError(f"data source {source.path!r}: cannot list {err.filename} ({err.strerror or err})")

    found: list[Path] = []
    for folder, folders, files in os.walk(base, onerror=refuse):
        found.extend(Path(folder) / name for name in (*folders, *files))
    return found


def regular_files(paths: list[Path], base: Path, source: SourceConfig) -> list[Path]:
    """The files among `paths` that are not hidden, in order. A folder or a pipe named like a data file is no file
    to read (a pipe would never end); a link to nothing is refused: it names data that is missing."""
    found = []
    for path in paths:
        if hidden(path, base):
            continue
        if path.is_symlink() and not path.exists():
            raise DataSourceError(f"data source {source.path!r}: {path} {broken_link(path)}")
        if path.is_file():
            found.append(path)
    return sorted(found)


def broken_link(path: Path) -> str:
    """What is wrong with a link that leads to no file."""
    try:
        os.stat(path)
    except OSError as err:
        if err.errno == errno.ELOOP:
            return f"links to {os.readlink(path)}, and the links lead back round in a loop"
    return f"links to {os.readlink(path)}, which does not exist"


def hidden(path: Path, base: Path) -> bool:
    """A file a folder or pattern does not take: one whose name, or a folder's on the way to it from `base`,
    starts with "." or "__" (`.DS_Store`, `__MACOSX/._data.jsonl`, `.ipynb_checkpoints/`), as datasets skips them."""
    return any(part.startswith((".", "__")) for part in path.relative_to(base).parts)


def glob_base(pattern: Path) -> Path:
    """The folder a pattern's wildcards start in."""
    parts = pattern.parts
    fixed = next((index for index, part in enumerate(parts) if glob.has_magic(part)), len(parts))
    return Path(*parts[:fixed]) if fixed else Path(".")


def is_saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_info.json").is_file() or (folder / "dataset_dict.json").is_file()


def readable_hash(path: Path, source: SourceConfig) -> str:
    """The file's content hash; a file that cannot be read (no permission) is one line naming it."""
    try:
        return hash_file_cached(path)
    except OSError as err:
        raise DataSourceError(f"data source {source.path or source.name!r}: cannot read {path} "
                              f"({err.strerror or err})") from None


def source_fingerprint_of(source: SourceConfig, files: list[Path], root: Path) -> dict[str, Any]:
    """What the artifact depends on: file contents, or for a hub dataset, a token that forces a fresh read."""
    if files:
        return {display_name(path, root): readable_hash(path, source) for path in files}
    # a hub dataset is known by its coordinates: pin `revision` for a version that cannot move
    return {"hub": source.name, "subset": source.subset, "split": source.split, "revision": source.revision}


def source_fingerprint(config: DataConfig, root: Path) -> str:
    """One hash of the configured data, as ingest records it in `data_sha256`."""
    return hash_json(fingerprints(locate_all(config, root), root))


def display_name(path: Path, root: Path) -> str:
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def write_records(located: list[tuple[SourceConfig, str, list[Path]]], config: DataConfig, kind: RecordKind,
                  folder: Path, root: Path, engine: EngineConfig | None = None) -> dict[str, Any]:
    """Every row read goes to exactly one of the records' parts and rejected.jsonl, in source order, any shards."""
    settings = engine or EngineConfig()
    scratch = Path(tempfile.mkdtemp(prefix=".shards-", dir=folder))
    try:
        with Engine(settings) as workers:
            shard_bytes = input_shard_size(located, settings)
            jobs = numbered(cut_sources(located, config, kind, root, scratch, shard_bytes), workers)
            done = workers.map("ingest", ingest_shard, jobs, rows=lambda result: sum(result["per_source"].values()))
            jobs, done = reread_whole_files(jobs, done, workers)
            spread = workers.figures()
        keep_as_parts([job.target.with_suffix(".records") for job in jobs], folder / RECORDS, shard_bytes)
        join_files([job.target.with_suffix(".rejected") for job in jobs], folder / "rejected.jsonl")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    per_source: Counter[str] = Counter()
    codes: Counter[str] = Counter()
    unread: list[str] = []
    for result in done:
        per_source.update(result["per_source"])
        codes.update(result["codes"])
        unread.extend(result["unread"])
    return {"rows_read": sum(per_source.values()), "rows_rejected": sum(codes.values()),
            "rows_per_source": dict(per_source), "reject_codes": sorted_counts(codes),
            "sources_not_read_to_the_end": len(unread), "unread_sources": unread, **spread}


def reread_whole_files(jobs: list[IngestJob], done: list[dict[str, Any]],
                       engine: Engine) -> tuple[list[IngestJob], list[dict[str, Any]]]:
    """A file with a shard that could not end at its cut (a quoted CSV field over it, a JSON array or Parquet file
    that breaks partway) read again as one shard."""
    broken = list(dict.fromkeys(job.file for job, result in zip(jobs, done, strict=True) if not result["whole"]))
    if not broken:
        return jobs, done
    first = {file: next(job for job in jobs if job.file == file) for file in broken}
    again = [whole(first[file]) for file in broken]
    redone = dict(zip(broken, engine.map("ingest: whole files", ingest_shard, again), strict=True))
    merged: list[tuple[IngestJob, dict[str, Any]]] = []
    for job, result in zip(jobs, done, strict=True):
        if job.file not in redone:
            merged.append((job, result))
        elif job is first[job.file]:
            merged.append((again[broken.index(job.file)], redone[job.file]))
    return [job for job, _ in merged], [result for _, result in merged]


def record_files(folder: Path) -> list[Path]:
    """The records of the ingest artifact in `folder`, in order: its parts' files."""
    return kept_parts(folder / RECORDS)


def read_records(folder: Path) -> Iterator[dict[str, Any]]:
    """The records of the ingest artifact in `folder`, in order."""
    yield from (row for path in record_files(folder) for row in read_written_jsonl(path))


def ingest_shard(job: IngestJob) -> dict[str, Any]:
    """One shard's rows to its .records and .rejected files; rows per source, reject codes and files not read to
    their end, and whether its last row ended inside it."""
    per_source: Counter[str] = Counter()
    codes: Counter[str] = Counter()
    unread: list[str] = []
    delimiter, quoted = csv_dialect(job.fmt or "", job.source)
    part = CsvPart(delimiter, job.span, job.header, quoted=quoted)
    with job.target.with_suffix(".records").open("w", encoding="utf-8") as out, \
         job.target.with_suffix(".rejected").open("w", encoding="utf-8") as bad:
        for name, line, row, reject in read_shard(job, part):
            per_source[name] += 1
            text = None
            if reject is None:
                text, reject = record_line(row or {}, job.config, job.kind, job.source, (name, line, job.split))
            if reject is None:
                out.write(text + "\n")
                continue
            codes[reject.code] += 1
            if reject.stops_file:
                unread.append(name)
            bad.write(json.dumps(reject.entry(name, line), ensure_ascii=False) + "\n")
    # a JSON array shard that breaks partway: one read of the file stops there, so the file is read again whole
    broken = job.fmt == "json_array" and job.span is not None and bool(unread)
    return {"per_source": dict(per_source), "codes": dict(codes), "unread": unread, "whole": part.whole and not broken}


# json.dumps(value, ensure_ascii=False), its encoder made once: dumps makes one per call, a third of a small call
TO_JSON = json.JSONEncoder(ensure_ascii=False).encode


def record_line(row: dict[str, Any], config: DataConfig, kind: RecordKind, source: SourceConfig,
                origin: tuple[str, int, str]) -> tuple[str | None, Reject | None]:
    """The canonical record as a JSON line, or why it cannot be one."""
    record = kind.canonical(row, source.columns)
    reject = foreign_value(record) if any(value is not None for value in record.values()) or not row \
        else unmatched(row, kind)
    if reject is not None:
        return None, reject
    text = TO_JSON(record)
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:  # e.g. a lone "\\ud83d" escape: not encodable as UTF-8
        field = next((key for key, value in record.items() if not utf8_encodable(value)), None)
        return None, Reject(RejectCode.UTF8_INVALID, "an unpaired surrogate escape (e.g. \\ud83d), which is not "
                            "text UTF-8 can hold", field=field, excerpt=excerpt(text))
    if size > config.max_record_bytes:
        return None, Reject(RejectCode.TOO_LARGE, too_large(size, config.max_record_bytes), excerpt=excerpt(text))
    name, line, split = origin
    return with_origin(text, record, {"_source": name, "_line": line, "_weight": source.weight, "_split": split}), None


def unmatched(row: dict[str, Any], kind: RecordKind) -> Reject:
    """A row that holds none of the kind's fields, under any name the kind knows: the columns it does hold are
    what the user needs to see (the record, all nulls, would show nothing)."""
    columns = ", ".join(map(repr, list(row)[:8])) + (", ..." if len(row) > 8 else "")
    return Reject(RejectCode.MISSING_FIELD, f"none of the {kind.name} fields ({', '.join(kind.fields)}) is in the "
                  f"row, which holds {columns}: map them with the source's columns, or set data.kind",
                  excerpt=excerpt(json.dumps(row, ensure_ascii=False, default=repr)))


def utf8_encodable(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def with_origin(text: str, record: dict[str, Any], origin: dict[str, Any]) -> str:
    """json.dumps of the record with its origin's fields after its own: the record's text extended, rather than
    the whole record serialised a second time."""
    if not record or any(key in record for key in origin):
        return json.dumps({**record, **origin}, ensure_ascii=False)
    return text[:-1] + ", " + TO_JSON(origin)[1:]


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



def read_shard(job: IngestJob, part: CsvPart) -> Iterator[tuple[str, int, dict[str, Any] | None, Reject | None]]:
    if job.fmt is None:
        name = job.source.name or job.source.path or ""
        for line, row, reject in read_dataset(job.source, job.root):
            yield name, line, row, reject
        return
    path, limit = job.files[0], job.config.max_record_bytes
    name = display_name(path, job.root)
    if job.fmt in ("csv", "tsv"):
        rows = read_csv_part(path, limit, part)
    elif job.fmt == "json_array":  # a top-level array ends its file; a field's array is followed by its object
        rows = read_json_array(path, limit, job.span, ends_file=job.source.field is None)
    elif job.span is not None:
        rows = SPAN_READERS.get(job.fmt, read_jsonl)(path, limit, job.span)
    else:
        rows = READERS[job.fmt](path, limit)
    for line, row, reject in decompressed(rows) if compression(path) else rows:
        yield name, line, row, reject


