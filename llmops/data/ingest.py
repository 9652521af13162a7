"""Ingest: read every configured source, streaming, into one file of canonical records.

Sources are JSONL, JSON arrays, CSV/TSV, Parquet, plain text (a document per line, or per file),
folders written by `datasets.save_to_disk`, and datasets read by `datasets.load_dataset`
(data/readers.py). Each row is mapped to the fields of the configured record kind (the selected
objective's: objectives/), and keeps its source and line (or row) number; a row that cannot be read
is not dropped but written to `rejected.jsonl` with its code and a message, for the quarantine.
Whatever the bytes, every row ends in exactly one of the two files.
"""

from __future__ import annotations

import glob
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llmops.core.artifacts import Figures, StageRecord
from llmops.core.config import DataConfig, PipelineConfig, SourceConfig
from llmops.core.rejects import CodeName, Reject, RejectCode, sorted_counts
from llmops.core.workspace import hash_file_cached, hash_json, project_root
from llmops.data.readers import READERS, DataSourceError, excerpt, read_dataset, too_large
from llmops.objectives import record_kind
from llmops.objectives.records import RecordKind

SUFFIX_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".csv": "csv", ".tsv": "tsv",
                  ".parquet": "parquet", ".txt": "text"}
# deeper JSON than any record needs; far deeper would exhaust Python's stack when written back
MAX_DEPTH = 64
# the types a JSON value can hold; anything else (bytes, dates from Parquet) is rejected, not stringified
JSON_TYPES = (str, int, float, bool, type(None), list, tuple, dict)


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

    NAMED_MAPS = ("reject_codes",)


IngestRecord = StageRecord[IngestFigures]


def ingest(config: PipelineConfig, folder: Path) -> IngestFigures:
    """Read the sources (relative paths are relative to the project) into `folder`."""
    root = project_root()
    located = locate_all(config.data, root)
    stats = write_records(located, config.data, record_kind(config.data), folder, root)
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
                  folder: Path, root: Path) -> dict[str, Any]:
    """Every row read goes to exactly one of records.jsonl and rejected.jsonl."""
    per_source: Counter[str] = Counter()
    codes: Counter[str] = Counter()
    unread: list[str] = []
    with (folder / "records.jsonl").open("w", encoding="utf-8") as out, \
         (folder / "rejected.jsonl").open("w", encoding="utf-8") as bad:
        for source, split, files in located:
            for name, line, row, reject in read_source(source, files, config, root):
                per_source[name] += 1
                text = None
                if reject is None:
                    text, reject = record_line(row or {}, config, kind, source, (name, line, split))
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

