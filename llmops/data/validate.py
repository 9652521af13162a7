"""Validate: a great-expectations suite per record kind, with a row-level quarantine.

Rows are checked in chunks, so memory stays bounded. Every failing row is written to
`quarantine.jsonl` with its source file, line, reject code, field and a message, next to the rows
ingest could not read. The good rows go on as the Parquet table `valid/` (io/tables.py), in
source order, cut into parts by row position. Past `max_bad_fraction` the run stops before training.
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, TypeVar

from llmops.config.engine import EngineConfig
from llmops.config.schema import DataConfig, PipelineConfig, ValidateConfig
from llmops.data.ingest import IngestRecord, record_files
from llmops.io.errors import UserError
from llmops.io.figures import Figures
from llmops.io.files import read_jsonl
from llmops.io.rejects import CodeName, sorted_counts
from llmops.io.shards import byte_ranges, join_files, lines_in
from llmops.io.table_types import ColumnTypes, add_types, json_columns, merge_types
from llmops.io.tables import part_jobs, write_index, write_lines_part
from llmops.objectives import record_kind
from llmops.pipeline.engine import Engine
from llmops.pipeline.stages import StageContext
from llmops.records.base import RecordKind
from llmops.store.artifacts import StageRecord

EXCERPT_CHARS = 200
T = TypeVar("T")


class DataQualityError(UserError, ValueError):
    """Too many rows failed validation; the message says how many, why and where they are."""


class ValidateFigures(Figures):
    rows_read: int
    rows_kept: int
    rows_quarantined: int
    bad_fraction: float
    # quarantined rows per reject code (each row counted once, by its first failure): metrics `validate.codes.<code>`
    codes: dict[CodeName, int]
    sources_not_read_to_the_end: int
    unread_sources: list[str]
    # how the work was spread (None in records made before it was): input shards, workers, the peak memory of the
    # largest worker
    shards: int | None = None
    workers: int | None = None
    peak_worker_rss_mb: float | None = None

    NAMED_MAPS = ("codes",)


ValidateRecord = StageRecord[ValidateFigures]


def validate(config: PipelineConfig, ingested: IngestRecord, context: StageContext) -> ValidateFigures:
    stats = split_valid_rows(config.validation, config.data, ingested.dir, context.folder, config.engine)
    if stats["rows_read"] != ingested.figures.rows_read:
        raise RuntimeError(f"validate counted {stats['rows_read']} rows, ingest {ingested.figures.rows_read}")
    return ValidateFigures(**stats, sources_not_read_to_the_end=ingested.figures.sources_not_read_to_the_end,
                           unread_sources=ingested.figures.unread_sources)


def split_valid_rows(config: ValidateConfig, data: DataConfig, source: Path, folder: Path,
                     engine: EngineConfig | None = None) -> dict[str, Any]:
    """Ingest's rejects, then each shard of its records validated on the engine: the quarantines joined in order, the
    kept rows as the table `valid/`."""
    kind = record_kind(data)
    settings = engine or EngineConfig()
    # only what the checks read travels to the workers
    checks = ValidateConfig(min_chars=config.min_chars, max_chars=config.max_chars, chunk_rows=config.chunk_rows)
    codes: Counter[str] = Counter()
    with (folder / "quarantine.jsonl").open("w", encoding="utf-8") as bad:
        for row in read_jsonl(source / "rejected.jsonl"):
            bad.write(json.dumps(row, ensure_ascii=False) + "\n")
            codes[row["code"]] += 1
    scratch = Path(tempfile.mkdtemp(prefix=".shards-", dir=folder))
    try:
        jobs = [ValidateJob(checks, kind, list(data.labels), ranges, scratch / f"part-{shard}")
                for shard, ranges in enumerate(record_shards(record_files(source), settings))]
        with Engine(settings) as workers:
            done = workers.map("validate", validate_shard, jobs, rows=lambda result: sum(result.counts.values()))
            kept_per_shard = [result.counts.pop(KEPT) for result in done]
            write_valid_table([job.target.with_suffix(".valid") for job in jobs], kept_per_shard,
                              merge_types(result.types for result in done), folder / "valid", workers)
            spread = workers.figures()
        join_files([job.target.with_suffix(".bad") for job in jobs], folder / "quarantine.jsonl", "a")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    kept = sum(kept_per_shard)
    for result in done:
        codes.update(result.counts)
    quarantined = sum(codes.values())
    rows_read = kept + quarantined
    return {"rows_read": rows_read, "rows_kept": kept, "rows_quarantined": quarantined,
            "bad_fraction": quarantined / rows_read if rows_read else 0.0, "codes": sorted_counts(codes), **spread}


# [start, end) of a file, in bytes, holding whole lines
LineRange = tuple[Path, int, int]


def record_shards(files: list[Path], settings: EngineConfig) -> list[tuple[LineRange, ...]]:
    """Ingest's record parts as shards of whole lines, each about the shard size: a part of twice the size or more
    cut into equal ones, a run of smaller ones taken together. A shard costs a validation run of its own, so
    ingest's parts, cut by the input's size alone, are not taken one for one."""
    shard = settings.shard_size(sum(path.stat().st_size for path in files))
    shards: list[tuple[LineRange, ...]] = []
    current: list[LineRange] = []
    held = 0
    for path in files:
        size = path.stat().st_size
        for start, end in byte_ranges(path, -(-size // max(size // shard, 1))):
            current.append((path, start, end))
            held += end - start
            if held >= shard:
                shards.append(tuple(current))
                current, held = [], 0
    return shards + ([tuple(current)] if current else [])


# the key of a shard's result that counts its kept rows (the others are reject codes)
KEPT = ""


@dataclass(frozen=True)
class ValidateJob:
    config: ValidateConfig
    kind: RecordKind
    labels: list[str]
    # the shard: byte ranges of whole lines of ingest's record files
    ranges: tuple[LineRange, ...]
    # the shard's files: this path with .valid and .bad
    target: Path


@dataclass(frozen=True)
class ShardResult:
    # kept rows (key KEPT) and quarantined rows per reject code
    counts: dict[str, int]
    # the column types of the kept rows
    types: ColumnTypes


def write_valid_table(files: list[Path], rows: list[int], types: ColumnTypes, folder: Path, engine: Engine) -> None:
    """The shards' kept rows, in order, as the table `folder`: each part one more job on the engine, made from the
    next ROWS_PER_PART rows of the shards' files."""
    parts = part_jobs(list(zip(files, rows, strict=True)), types, folder)
    write_index(folder, engine.map("validate: parts", write_lines_part, parts, rows=lambda part: part["rows"]),
                json_columns(types))


def validate_shard(job: ValidateJob) -> ShardResult:
    """One shard's rows checked in chunks; its kept rows to its .valid file, its quarantined rows to its .bad file."""
    suite = build_suite(job.config, job.kind, job.labels)
    counts: Counter[str] = Counter({KEPT: 0})
    types: ColumnTypes = {}
    lines = (line for path, start, end in job.ranges for _, line in lines_in(path, start, end))
    with job.target.with_suffix(".valid").open("wb") as good, \
         job.target.with_suffix(".bad").open("w", encoding="utf-8") as bad:
        for block in chunks(lines, job.config.chunk_rows):
            chunk = [json.loads(line) for line in block]
            failures = failing_rows(suite, chunk, job.kind, job.labels)
            for index, (line, row) in enumerate(zip(block, chunk, strict=True)):
                if index in failures:
                    entry = quarantine_entry(row, failures[index], job.kind, job.config, job.labels)
                    bad.write(json.dumps(entry, ensure_ascii=False) + "\n")
                    counts[entry["code"]] += 1
                else:
                    valid = job.kind.valid_row(row, job.labels)
                    good.write(valid_line(line, row, valid))
                    add_types(types, valid)
                    counts[KEPT] += 1
    return ShardResult(dict(counts), types)


def valid_line(line: bytes, row: dict[str, Any], valid: dict[str, Any]) -> bytes:
    """A kept row (as the kind keeps it) as a JSON line. Ingest wrote the line as json.dumps writes the row, so a
    row the kind keeps as it is goes out as read: serialising it again would make the same bytes, slowly."""
    if valid is row:
        return line if line.endswith(b"\n") else line + b"\n"
    return (json.dumps(valid, ensure_ascii=False) + "\n").encode("utf-8")


def chunks(rows: Iterable[T], size: int) -> Iterator[list[T]]:
    rows = iter(rows)
    while chunk := list(islice(rows, size)):
        yield chunk


def quarantine_entry(row: dict[str, Any], failures: list[tuple[str, str]], kind: RecordKind,
                     config: ValidateConfig, labels: list[str]) -> dict[str, Any]:
    """The row's first failure gives its code and field; the message names every failure, with the detail."""
    content = {k: v for k, v in row.items() if not k.startswith("_")}
    code, field = failures[0]
    message = "; ".join(kind.describe(c, f, row, config, labels) for c, f in failures)
    return {"source": row["_source"], "line": row["_line"], "code": str(code), "field": field, "message": message,
            "excerpt": json.dumps(content, ensure_ascii=False)[:EXCERPT_CHARS]}


@functools.cache
def gx_context() -> Any:
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    return context


@contextmanager
def without_batch_fingerprints() -> Iterator[None]:
    """The pandas engine hashes every batch under 1 GB of (shallow) memory into a fingerprint for its data docs:
    for a chunk of long texts, which count 8 bytes each, that is hashing every text twice per chunk, the largest
    part of validate's time. Nothing here reads the fingerprint (an ephemeral context, no data docs). The switch is
    the library's module setting, so it is put back after each chunk: other validations in the process keep theirs."""
    from great_expectations.execution_engine import pandas_execution_engine

    before = pandas_execution_engine.HASH_THRESHOLD
    pandas_execution_engine.HASH_THRESHOLD = 0
    try:
        yield
    finally:
        pandas_execution_engine.HASH_THRESHOLD = before


def build_suite(config: ValidateConfig, kind: RecordKind, labels: list[str]) -> Any:
    """The suite of the record kind, most basic checks first; each expectation carries its reject code and field."""
    import great_expectations as gx

    gx_context()  # suites belong to a context: the ephemeral one, created once per process
    suite = gx.ExpectationSuite(name=f"llmops-{kind.name}")

    def expect(expectation: Any, reject: str, field: str) -> None:
        expectation.meta = {"code": str(reject), "field": field}
        suite.add_expectation(expectation)

    kind.expectations(expect, gx.expectations, config, labels)
    return suite


def chunk_frame(chunk: list[dict[str, Any]], kind: RecordKind, labels: list[str] | None = None) -> Any:
    """Columns the expectations can read whatever a row holds (the kind derives them from its fields)."""
    import pandas as pd

    columns = kind.frame(chunk, labels or [])
    return pd.DataFrame({name: pd.Series(values, dtype=object) for name, values in columns.items()})


def failing_rows(suite: Any, chunk: list[dict[str, Any]], kind: RecordKind,
                 labels: list[str] | None = None) -> dict[int, list[tuple[str, str]]]:
    """Run the suite on one chunk; map each failing row's index to its (code, field) failures, in suite order."""
    with without_batch_fingerprints():
        batch = batch_definition().get_batch(batch_parameters={"dataframe": chunk_frame(chunk, kind, labels)})
        result = batch.validate(suite, result_format={"result_format": "COMPLETE"})
    rank = {(e.meta["code"], e.meta["field"]): order for order, e in enumerate(suite.expectations)}
    failures: dict[int, list[tuple[str, str]]] = {}
    for outcome in result.results:
        if outcome.success:
            continue
        raised = (outcome.exception_info or {}).get("raised_exception")
        if raised:
            raise RuntimeError(f"validation could not run {outcome.expectation_config.type}: "
                               f"{outcome.exception_info.get('exception_message')}")
        for index in outcome.result.get("unexpected_index_list") or []:
            meta = outcome.expectation_config.meta
            failures.setdefault(int(index), []).append((meta["code"], meta["field"]))
    # results come grouped by metric, not in suite order: the most basic failure of a row comes first
    return {index: sorted(found, key=lambda failure: rank[failure])
            for index, found in failures.items()}


@functools.cache
def batch_definition() -> Any:
    source = gx_context().data_sources.add_pandas("llmops")
    return source.add_dataframe_asset("records").add_batch_definition_whole_dataframe("chunk")


def check_bad_fraction(config: PipelineConfig, record: ValidateRecord) -> None:
    """Stop the run before training when too many rows failed, none is left, or a file could not be read to its end."""
    figures, limit = record.figures, config.validation.max_bad_fraction
    quarantine = record.dir / "quarantine.jsonl"
    if figures.sources_not_read_to_the_end:
        files = ", ".join(figures.unread_sources[:3]) + (", ..." if len(figures.unread_sources) > 3 else "")
        raise DataQualityError(
            f"{figures.sources_not_read_to_the_end} source file(s) could not be read to the end ({files}); "
            f"training on part of a file is refused: see the quarantine, {quarantine}")
    top = ", ".join(f"{code} ({count})" for code, count in list(figures.codes.items())[:3])
    if figures.rows_kept == 0:
        # caught here rather than at dedup's empty split: the cause is the data, and the quarantine shows it
        held = f"all {figures.rows_read} rows failed validation; main reasons: {top}" if figures.rows_read else \
            "the data holds no rows (sources: " + ", ".join(str(s.path or s.name) for s in config.data.sources) + ")"
        raise DataQualityError(f"nothing to train on: {held}; quarantine: {quarantine}")
    if figures.bad_fraction <= limit:
        return
    raise DataQualityError(
        f"{figures.rows_quarantined} of {figures.rows_read} rows failed validation "
        f"({figures.bad_fraction:.1%} > validate.max_bad_fraction {limit:.1%}); "
        f"main reasons: {top}; quarantine: {quarantine}"
    )
