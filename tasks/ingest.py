"""Ingest: read JSONL, CSV or Parquet sources into one stream of canonical records.

Every row keeps its source file and line (or row) number; a row that cannot be parsed is not
dropped but written to `rejected.jsonl` with the reason, for the quarantine.
"""

from __future__ import annotations

import csv
import glob
import json
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from flows.config import DataConfig, PipelineConfig
from tasks import tracking, workspace
from tasks.tracking import RunHandle
from tasks.versions import data_version
from tasks.workspace import StageRecord

FIELDS = {"text": ("text",), "instruction": ("instruction", "input", "output")}
SUFFIX_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet"}
EXCERPT_CHARS = 200


class DataSourceError(FileNotFoundError):
    """The configured data cannot be found or read."""


def ingest(config: DataConfig, root: Path) -> StageRecord:
    sources = resolve_sources(config.path, root)
    source_hashes = hash_sources(sources, root)
    version = data_version(sources[0], root)
    relevant = config.model_dump(include={"path", "format", "kind", "columns"})
    key = workspace.stage_key("ingest", relevant, [], workspace.code_version(sys.modules[__name__]),
                              sources=source_hashes)

    def build(folder: Path) -> tuple[str, dict[str, Any]]:
        stats = write_records(sources, config, folder, root)
        stats["data_sha256"] = workspace.hash_json(source_hashes)  # what source_fingerprint returns
        return workspace.hash_file(folder / "records.jsonl"), stats

    record = workspace.build_artifact("ingest", key, build)
    # the DVC state is read on every run: `dvc add` may have pinned the same bytes since
    record.stats.update(version.model_dump())
    return record


def hash_sources(sources: list[Path], root: Path) -> dict[str, str]:
    """Each file's content hash, by its name relative to the project (so a moved checkout hashes the same)."""
    return {display_name(path, root): workspace.hash_file(path) for path in sources}


def source_fingerprint(config: DataConfig, root: Path) -> str:
    """One hash of the configured data files' names and bytes."""
    return workspace.hash_json(hash_sources(resolve_sources(config.path, root), root))


def resolve_sources(pattern: str, root: Path) -> list[Path]:
    """A file, a folder (its data files) or a glob, relative to the project root."""
    base = Path(pattern) if Path(pattern).is_absolute() else root / pattern
    if base.is_file():
        return [base]
    if base.is_dir():
        found = sorted(p for p in base.rglob("*") if p.suffix.lower() in SUFFIX_FORMATS)
    else:
        found = sorted(Path(p) for p in glob.glob(str(base), recursive=True) if Path(p).is_file())
    if not found:
        raise DataSourceError(f"data.path {pattern!r}: no data file found at {base}")
    return found


def source_format(path: Path, configured: str) -> str:
    if configured != "auto":
        return configured
    fmt = SUFFIX_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise DataSourceError(f"{path}: cannot tell the format from the suffix; set data.format")
    return fmt


def write_records(sources: list[Path], config: DataConfig, folder: Path, root: Path) -> dict[str, Any]:
    fields = FIELDS[config.kind]
    per_source: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    read = rejected = 0
    with (folder / "records.jsonl").open("w", encoding="utf-8") as out, \
         (folder / "rejected.jsonl").open("w", encoding="utf-8") as bad:
        for path in sources:
            name = display_name(path, root)
            for line, row, problem in read_rows(path, source_format(path, config.format)):
                read += 1
                per_source[name] += 1
                if problem is not None:
                    rejected += 1
                    reasons[problem[0]] += 1
                    bad.write(json.dumps({"source": name, "line": line, "reason": problem[0],
                                          "excerpt": problem[1][:EXCERPT_CHARS]}, ensure_ascii=False) + "\n")
                    continue
                record = {field: row.get(config.columns.get(field, field)) for field in fields}
                record.update(_source=name, _line=line)
                out.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
    return {"rows_read": read, "rows_rejected": rejected, "rows_per_source": dict(per_source),
            "reject_reasons": dict(reasons)}


def display_name(path: Path, root: Path) -> str:
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


Row = tuple[int, dict[str, Any], tuple[str, str] | None]


def read_rows(path: Path, fmt: str) -> Iterator[Row]:
    readers = {"jsonl": read_jsonl_rows, "csv": read_csv_rows, "parquet": read_parquet_rows}
    yield from readers[fmt](path)


def read_jsonl_rows(path: Path) -> Iterator[Row]:
    """One JSON object per line; lines are read as bytes so that bad bytes cost one row, not the file."""
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            raw = raw.rstrip(b"\r\n")
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield number, {}, (f"invalid UTF-8 at byte {err.start}", raw.decode("utf-8", "replace"))
                continue
            try:
                value = json.loads(text)
            except json.JSONDecodeError as err:
                yield number, {}, (f"broken JSON ({err.msg}, column {err.colno})", text)
                continue
            if not isinstance(value, dict):
                yield number, {}, (f"not a JSON object but a {type(value).__name__}", text)
                continue
            yield number, value, None


def read_csv_rows(path: Path) -> Iterator[Row]:
    """CSV with a header row; row numbers are the file's line numbers (the header is line 1)."""
    with path.open("r", encoding="utf-8-sig", errors="surrogateescape", newline="") as handle:
        reader = csv.DictReader(handle)
        start = 2
        for row in reader:
            line = start
            start = reader.line_num + 1
            text = ",".join(str(v) for v in row.values())
            if any(isinstance(v, str) and has_surrogates(v) for v in row.values()):
                yield line, {}, ("invalid UTF-8", text.encode("utf-8", "surrogateescape").decode("utf-8", "replace"))
                continue
            if None in row:
                yield line, {}, (f"{len(row[None]) + len(reader.fieldnames or [])} fields, header has "
                                 f"{len(reader.fieldnames or [])}", text)
                continue
            yield line, dict(row), None


def has_surrogates(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def read_parquet_rows(path: Path, batch_rows: int = 10_000) -> Iterator[Row]:
    """Parquet in record batches, so memory stays bounded; row numbers count from 1."""
    import pyarrow.parquet as pq

    number = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_rows):
        for row in batch.to_pylist():
            number += 1
            yield number, row, None



@task(name="ingest", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def ingest_task(config: PipelineConfig, run: RunHandle) -> StageRecord:
    return tracking.tracked(run, lambda: ingest(config.data, workspace.project_root()))
