"""Ingest: read every configured source, streaming, into one file of canonical records.

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
file or a source per shard. The shards' files are joined in order, so the artifact is the same bytes
whatever the engine, shard size and worker count. A CSV file whose quoted field spans a cut, and a
Parquet file or JSON array that breaks partway, are read again whole.
"""

from __future__ import annotations

import glob
import json
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from itertools import accumulate, groupby
from pathlib import Path
from typing import Any

from llmops.core.artifacts import Figures, StageRecord
from llmops.core.config import DataConfig, PipelineConfig, SourceConfig
from llmops.core.config_engine import EngineConfig
from llmops.core.engine import Engine
from llmops.core.rejects import CodeName, Reject, RejectCode, sorted_counts
from llmops.core.shards import (
    array_ranges,
    byte_ranges,
    count_line_ends,
    count_lines,
    join_files,
    row_group_ranges,
    row_group_rows,
)
from llmops.core.workspace import hash_file_cached, hash_json, project_root
from llmops.data.json_array import read_json_array
from llmops.data.readers import (
    READERS,
    CsvPart,
    DataSourceError,
    Span,
    csv_header,
    excerpt,
    is_json_array,
    read_csv_part,
    read_dataset,
    read_jsonl,
    read_parquet,
    read_text_lines,
    too_large,
)
from llmops.objectives import record_kind
from llmops.objectives.records import RecordKind

SUFFIX_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".csv": "csv", ".tsv": "tsv",
                  ".parquet": "parquet", ".txt": "text"}
# deeper JSON than any record needs; far deeper would exhaust Python's stack when written back
MAX_DEPTH = 64
# the types a JSON value can hold; anything else (bytes, dates from Parquet) is rejected, not stringified
JSON_TYPES = (str, int, float, bool, type(None), list, tuple, dict)
# the readers of a span of a file, by the format ingest reads the file as (jsonl for the rest)
SPAN_READERS = {"text": read_text_lines, "parquet": read_parquet, "json_array": read_json_array}


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


def ingest(config: PipelineConfig, folder: Path) -> IngestFigures:
    """Read the sources (relative paths are relative to the project) into `folder`, shard by shard on the engine."""
    root = project_root()
    located = locate_all(config.data, root)
    stats = write_records(located, config.data, record_kind(config.data), folder, root, config.engine)
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
        return {display_name(path, root): hash_file_cached(path) for path in files}
    # a hub dataset is known by its coordinates: pin `revision` for a version that cannot move
    return {"hub": source.name, "subset": source.subset, "split": source.split, "revision": source.revision}


def source_fingerprint(config: DataConfig, root: Path) -> str:
    """One hash of the configured data, as ingest records it in `data_sha256`."""
    return hash_json(fingerprints(locate_all(config, root), root))


def display_name(path: Path, root: Path) -> str:
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def write_records(located: list[tuple[SourceConfig, str, list[Path]]], config: DataConfig, kind: RecordKind,
                  folder: Path, root: Path, engine: EngineConfig | None = None) -> dict[str, Any]:
    """Every row read goes to exactly one of records.jsonl and rejected.jsonl, in source order whatever the shards."""
    settings = engine or EngineConfig()
    scratch = Path(tempfile.mkdtemp(prefix=".shards-", dir=folder))
    try:
        with Engine(settings) as workers:
            shard_bytes = input_shard_size(located, settings)
            jobs = numbered(cut_sources(located, config, kind, root, scratch, shard_bytes), workers)
            done = workers.map("ingest", ingest_shard, jobs, rows=lambda result: sum(result["per_source"].values()))
            jobs, done = reread_whole_files(jobs, done, workers)
            spread = workers.figures()
        join_files([job.target.with_suffix(".records") for job in jobs], folder / "records.jsonl")
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


@dataclass(frozen=True)
class IngestJob:
    source: SourceConfig
    split: str
    config: DataConfig
    kind: RecordKind
    root: Path
    # the files of a dataset source, else the one file this shard is part of
    files: list[Path]
    # the reader's format; None for a dataset source
    fmt: str | None
    # the bytes of the file this shard reads, and its first line's number (None: the whole file)
    span: Span | None
    # the shard's files: this path with .records and .rejected
    target: Path
    # a CSV file's header, for a shard that does not start the file
    header: list[str] | None = None
    # which file of the stage the shard is part of: the shards of one file are read again whole if need be
    file: int = 0


def input_shard_size(located: list[tuple[SourceConfig, str, list[Path]]], settings: EngineConfig) -> int:
    """One shard size for all the sources, from their files' total size."""
    return settings.shard_size(sum(path.stat().st_size for _, _, files in located for path in files))


def cut_sources(located: list[tuple[SourceConfig, str, list[Path]]], config: DataConfig, kind: RecordKind,
                root: Path, scratch: Path, shard_bytes: int) -> list[IngestJob]:
    """A job per shard, in source order; spans still to be numbered. A dataset source is one shard."""
    jobs: list[IngestJob] = []
    for source, split, files in located:
        if source.name is not None or is_saved_dataset_files(files):
            jobs.append(IngestJob(source, split, config, kind, root, files, None, None, scratch / f"part-{len(jobs)}",
                                  file=jobs[-1].file + 1 if jobs else 0))
            continue
        for path in files:
            fmt = source_format(path, source.format)
            header = csv_header(path, config.max_record_bytes, "\t" if fmt == "tsv" else ",") \
                if fmt in ("csv", "tsv") else None
            fmt = "json_array" if fmt == "json" and is_json_array(path) else fmt
            ranges = cut_file(path, fmt, shard_bytes, config.max_record_bytes, header is not None)
            file = jobs[-1].file + 1 if jobs else 0
            for cut in ranges if len(ranges) > 1 else [None]:
                # until numbered, a span holds the header's line number where it is a CSV file's
                span = None if cut is None else (*cut, header[1] if header else 0)
                jobs.append(IngestJob(source, split, config, kind, root, [path], fmt, span,
                                      scratch / f"part-{len(jobs)}", header[0] if header and span else None, file))
    return jobs


def cut_file(path: Path, fmt: str, shard_bytes: int, longest: int, has_header: bool) -> list[tuple[int, int]]:
    """A file's shards: row groups of Parquet, objects of a JSON array, whole lines of the rest (CSV only with a
    header, which the shards after the first are read with); none for a file read whole."""
    if fmt == "parquet":
        return row_group_ranges(path, shard_bytes)
    if fmt == "json_array":
        return array_ranges(path, shard_bytes, longest)
    return byte_ranges(path, shard_bytes) if fmt in ("jsonl", "json", "text") or has_header else []


def numbered(jobs: list[IngestJob], engine: Engine) -> list[IngestJob]:
    """Each span given the number of its first line, from the lines of the spans before it (counted on the engine).
    A CSV file's first span grows until it holds the header (its line number was kept in the span until now)."""
    spans = [job for job in jobs if job.span is not None]
    counts = engine.map("ingest: lines", count_span, spans, rows=lambda lines: lines)
    lines_of = {id(job): lines for job, lines in zip(spans, counts, strict=True)}
    out: list[IngestJob] = []
    for _, of_file in groupby(jobs, key=lambda job: job.file):  # a file's shards are next to each other
        shards = list(of_file)
        if shards[0].span is None:
            out.extend(shards)
            continue
        sizes = [lines_of[id(job)] for job in shards]
        header_line = shards[0].span[2]
        while header_line and len(shards) > 1 and sizes[0] < header_line:  # the header runs past the first span
            first, second = shards.pop(0), shards.pop(0)
            shards.insert(0, replace(first, span=(first.span[0], second.span[1], 0)))
            sizes[:2] = [sizes[0] + sizes[1]]
        starts = [1, *(total + 1 for total in accumulate(sizes[:-1]))]
        out.extend(replace(job, span=(job.span[0], job.span[1], first_line), header=job.header if index else None)
                   for index, (job, first_line) in enumerate(zip(shards, starts, strict=True)))
    return out


def count_span(job: IngestJob) -> int:
    start, end, _ = job.span
    counter = {"parquet": row_group_rows, "json_array": count_line_ends}.get(job.fmt or "", count_lines)
    return counter(job.files[0], start, end)


def reread_whole_files(jobs: list[IngestJob], done: list[dict[str, Any]],
                       engine: Engine) -> tuple[list[IngestJob], list[dict[str, Any]]]:
    """A file with a shard that could not end at its cut (a quoted CSV field over it) read again as one shard."""
    broken = list(dict.fromkeys(job.file for job, result in zip(jobs, done, strict=True) if not result["whole"]))
    if not broken:
        return jobs, done
    first = {file: next(job for job in jobs if job.file == file) for file in broken}
    again = [replace(first[file], span=None, header=None) for file in broken]
    redone = dict(zip(broken, engine.map("ingest: whole files", ingest_shard, again), strict=True))
    merged: list[tuple[IngestJob, dict[str, Any]]] = []
    for job, result in zip(jobs, done, strict=True):
        if job.file not in redone:
            merged.append((job, result))
        elif job is first[job.file]:
            merged.append((again[broken.index(job.file)], redone[job.file]))
    return [job for job, _ in merged], [result for _, result in merged]


def ingest_shard(job: IngestJob) -> dict[str, Any]:
    """One shard's rows to its .records and .rejected files; rows per source, reject codes and files not read to
    their end, and whether its last row ended inside it."""
    per_source: Counter[str] = Counter()
    codes: Counter[str] = Counter()
    unread: list[str] = []
    part = CsvPart("\t" if job.fmt == "tsv" else ",", job.span, job.header)
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
    # a Parquet or JSON array shard that breaks partway: one read of the file stops there, so the file is read again
    # whole
    broken = job.fmt in ("parquet", "json_array") and job.span is not None and bool(unread)
    return {"per_source": dict(per_source), "codes": dict(codes), "unread": unread, "whole": part.whole and not broken}


def record_line(row: dict[str, Any], config: DataConfig, kind: RecordKind, source: SourceConfig,
                origin: tuple[str, int, str]) -> tuple[str | None, Reject | None]:
    """The canonical record as a JSON line, or why it cannot be one."""
    record = kind.canonical(row, source.columns)
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
    return with_origin(text, record, {"_source": name, "_line": line, "_weight": source.weight, "_split": split}), None


def with_origin(text: str, record: dict[str, Any], origin: dict[str, Any]) -> str:
    """json.dumps of the record with its origin's fields after its own: the record's text extended, rather than
    the whole record serialised a second time."""
    if not record or any(key in record for key in origin):
        return json.dumps({**record, **origin}, ensure_ascii=False)
    return text[:-1] + ", " + json.dumps(origin, ensure_ascii=False)[1:]


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
    elif job.span is not None:
        rows = SPAN_READERS.get(job.fmt, read_jsonl)(path, limit, job.span)
    else:
        rows = SPAN_READERS[job.fmt](path, limit) if job.fmt == "json_array" else READERS[job.fmt](path, limit)
    for line, row, reject in rows:
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

