"""How ingest cuts its sources into shards: a job per shard, and the number of each shard's first line.

JSONL, JSON that is no array, CSV/TSV and text are cut by byte ranges on line boundaries, Parquet by
runs of row groups, JSON arrays (whole files, or a JSON object's `field`) by byte ranges that start at
one of the array's objects; text-per-file, datasets and compressed files (`.gz`, `.bz2`, `.xz`, `.zst`)
are a file or a source per shard. Lines are counted shard by shard on the engine, so that each shard
numbers its rows as one read of its file does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import accumulate, groupby
from pathlib import Path

from llmops.config.engine import EngineConfig
from llmops.config.schema import DataConfig, SourceConfig
from llmops.data.readers import DataSourceError, Span, csv_header, is_json_array
from llmops.data.rows import has_surrogates
from llmops.io.compressed import DECOMPRESSION_ERRORS, compression, data_suffix
from llmops.io.shards import (
    array_ranges,
    byte_ranges,
    count_json_lines,
    count_line_ends,
    count_lines,
    field_array,
    open_range,
    row_group_ranges,
    row_group_rows,
)
from llmops.pipeline.engine import Engine
from llmops.records.base import RecordKind

SUFFIX_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".csv": "csv", ".tsv": "tsv",
                  ".parquet": "parquet", ".txt": "text"}
# byte-order marks of the encodings other than UTF-8 that a text file may start with, longest first (UTF-32's
# little-endian one starts as UTF-16's)
WIDE_BOMS = {b"\xff\xfe\x00\x00": "UTF-32 (little-endian)", b"\x00\x00\xfe\xff": "UTF-32 (big-endian)",
             b"\xff\xfe": "UTF-16 (little-endian)", b"\xfe\xff": "UTF-16 (big-endian)"}


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
    """One shard size for all the sources, from their files' total size alone: the shards' records become the
    artifact's parts."""
    return settings.cut_size(sum(path.stat().st_size for _, _, files in located for path in files))


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
            check_encoding(path, fmt)
            header = csv_header(path, config.max_record_bytes, *csv_dialect(fmt, source)) \
                if fmt in ("csv", "tsv") else None
            if header:
                check_header(path, header[0], kind, source)
            fmt = "json_array" if fmt == "json" and (source.field or is_json_array(path)) else fmt
            cuts, before = file_cuts(path, fmt, source.field, shard_bytes, config.max_record_bytes, header)
            file = jobs[-1].file + 1 if jobs else 0
            for cut in cuts or [None]:
                span = None if cut is None else (*cut, before)
                jobs.append(IngestJob(source, split, config, kind, root, [path], fmt, span,
                                      scratch / f"part-{len(jobs)}", header[0] if header and span else None, file))
    return jobs


def file_cuts(path: Path, fmt: str, field: str | None, shard_bytes: int, longest: int,
              header: tuple[list[str], int] | None) -> tuple[list[tuple[int, int]], int]:
    """A file's shards (none: it is read whole), and what their spans hold until numbered: a CSV file's header
    line, or the lines before the array of a JSON file's `field`."""
    if compression(path) is not None:
        if fmt == "parquet" or field is not None:
            what = "a Parquet file compresses its own columns" if fmt == "parquet" else "a field is read from a " \
                "JSON file as it is on disk"
            raise DataSourceError(f"{path}: {what}; give the file uncompressed")
        return [], 0
    if field is None:
        ranges = cut_file(path, fmt, shard_bytes, longest, header is not None)
        return ranges if len(ranges) > 1 else [], header[1] if header else 0
    start = field_array(path, field) if fmt == "json_array" else None
    if start is None:
        raise DataSourceError(f"{path}: the source's field {field!r} names no array at the top of a JSON object "
                              f"in this file")
    ranges = array_ranges(path, shard_bytes, longest, start) or [(start, path.stat().st_size)]
    return ranges, count_line_ends(path, 0, start)


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
    A CSV file's first span grows until it holds the header (its line number was kept in the span until now); a
    JSON field's spans start after the lines before its array (kept there too)."""
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
        csv, held = shards[0].header is not None, shards[0].span[2]
        while csv and len(shards) > 1 and sizes[0] < held:  # the header runs past the first span
            first, second = shards.pop(0), shards.pop(0)
            shards.insert(0, replace(first, span=(first.span[0], second.span[1], 0)))
            sizes[:2] = [sizes[0] + sizes[1]]
        before = 0 if csv else held  # the lines before a JSON field's array
        starts = [before + 1, *(before + total + 1 for total in accumulate(sizes[:-1]))]
        out.extend(replace(job, span=(job.span[0], job.span[1], first_line), header=job.header if index else None)
                   for index, (job, first_line) in enumerate(zip(shards, starts, strict=True)))
    return out


def count_span(job: IngestJob) -> int:
    start, end, _ = job.span
    counter = {"parquet": row_group_rows, "json_array": count_line_ends,
               "jsonl": count_json_lines}.get(job.fmt or "", count_lines)
    return counter(job.files[0], start, end)


def whole(first: IngestJob) -> IngestJob:
    """A file's first shard grown to the whole file; a JSON array's still starts where its first shard does (a
    field's array lies inside its file)."""
    if first.fmt == "json_array" and first.span is not None:
        return replace(first, span=(first.span[0], first.files[0].stat().st_size, first.span[2]), header=None)
    return replace(first, span=None, header=None)


def is_saved_dataset_files(files: list[Path]) -> bool:
    return any(p.name in ("dataset_info.json", "dataset_dict.json") for p in files)


def csv_dialect(fmt: str, source: SourceConfig) -> tuple[str, bool]:
    """A CSV or TSV file's delimiter, and whether its fields may be quoted."""
    delimiter = source.delimiter or ("\t" if fmt == "tsv" else ",")
    return delimiter, source.quoting == "csv" or (source.quoting == "auto" and fmt == "csv")


def check_header(path: Path, header: list[str], kind: RecordKind, source: SourceConfig) -> None:
    """Refuse a CSV file none of whose columns holds a field of the kind: every row would be quarantined for a
    missing field, where the cause is the file's delimiter or the source's column names."""
    unknown = next(((field, column) for field, column in source.columns.items() if column not in header), None)
    if unknown is not None:
        field, column = unknown
        raise DataSourceError(f"{path}: the source's columns map {field} to {column!r}, which is no column of its "
                              f"header ({', '.join(header)[:200]})")
    expected = kind.source_columns(source.columns)
    if expected & set(header):
        return
    stray = next((mark for mark in (";", "|", ",", "\t") if len(header) == 1 and mark in header[0]), None)
    garbled = next((number for number, name in enumerate(header, start=1) if has_surrogates(name)), None)
    hint = f"its one column holds {stray!r}: set the source's delimiter" if stray else \
        f"its column {garbled} is not UTF-8 text: save the file as UTF-8" if garbled else \
        "map your columns to the fields with the source's columns"
    raise DataSourceError(f"{path}: no column of its header ({', '.join(header)[:200]}) holds a field of kind "
                          f"{kind.name} ({', '.join(sorted(expected))}); {hint}")


def check_encoding(path: Path, fmt: str) -> None:
    """Refuse a text file in a wide encoding, which every reader here would take for UTF-8 and find broken in
    every line (a reject per line, and a row more for the last line's end)."""
    if fmt == "parquet":
        return
    try:
        with open_range(path) as handle:
            start = handle.read(4)
    except DECOMPRESSION_ERRORS:
        return  # the reader quarantines what it cannot decompress
    encoding = next((name for mark, name in WIDE_BOMS.items() if start.startswith(mark)), None)
    if encoding is not None:
        raise DataSourceError(f"{path}: the file is {encoding} text (its byte-order mark says so); save it as UTF-8")


def source_format(path: Path, configured: str) -> str:
    if configured not in ("auto", "hub", "arrow"):
        return configured
    fmt = SUFFIX_FORMATS.get(data_suffix(path))
    if fmt is None:
        raise DataSourceError(f"{path}: cannot tell the format from the suffix; set the source's format")
    return fmt

