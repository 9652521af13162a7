"""Validate: a great-expectations suite per record kind, with a row-level quarantine.

Rows are checked in chunks, so memory stays bounded. Every failing row is written to
`quarantine.jsonl` with its source file, line, reject code, field and a message, next to the rows
ingest could not read; the good rows go on. Past `max_bad_fraction` the run stops before training.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

from llmops.core.artifacts import Figures, StageRecord
from llmops.core.config import DataConfig, PipelineConfig, ValidateConfig
from llmops.core.errors import UserError
from llmops.core.rejects import CodeName, sorted_counts
from llmops.core.workspace import read_jsonl
from llmops.data.ingest import IngestRecord
from llmops.objectives import record_kind
from llmops.objectives.records import RecordKind

EXCERPT_CHARS = 200


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

    NAMED_MAPS = ("codes",)


ValidateRecord = StageRecord[ValidateFigures]


def validate(config: PipelineConfig, ingested: IngestRecord, folder: Path) -> ValidateFigures:
    stats = split_valid_rows(config.validation, config.data, ingested.dir, folder)
    if stats["rows_read"] != ingested.figures.rows_read:
        raise RuntimeError(f"validate counted {stats['rows_read']} rows, ingest {ingested.figures.rows_read}")
    return ValidateFigures(**stats, sources_not_read_to_the_end=ingested.figures.sources_not_read_to_the_end,
                           unread_sources=ingested.figures.unread_sources)


def split_valid_rows(config: ValidateConfig, data: DataConfig, source: Path, folder: Path) -> dict[str, Any]:
    kind = record_kind(data)
    suite = build_suite(config, kind, data.labels)
    codes: Counter[str] = Counter()
    kept = 0
    with (folder / "valid.jsonl").open("w", encoding="utf-8") as good, \
         (folder / "quarantine.jsonl").open("w", encoding="utf-8") as bad:
        for row in read_jsonl(source / "rejected.jsonl"):
            bad.write(json.dumps(row, ensure_ascii=False) + "\n")
            codes[row["code"]] += 1
        for chunk in read_chunks(source / "records.jsonl", config.chunk_rows):
            failures = failing_rows(suite, chunk, kind, data.labels)
            for index, row in enumerate(chunk):
                if index in failures:
                    entry = quarantine_entry(row, failures[index], kind, config, data.labels)
                    bad.write(json.dumps(entry, ensure_ascii=False) + "\n")
                    codes[entry["code"]] += 1
                else:
                    good.write(json.dumps(kind.valid_row(row, data.labels), ensure_ascii=False) + "\n")
                    kept += 1
    quarantined = sum(codes.values())
    rows_read = kept + quarantined
    return {"rows_read": rows_read, "rows_kept": kept, "rows_quarantined": quarantined,
            "bad_fraction": quarantined / rows_read if rows_read else 0.0, "codes": sorted_counts(codes)}


def read_chunks(path: Path, size: int) -> Iterator[list[dict[str, Any]]]:
    rows = iter(read_jsonl(path))
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
    """Stop the run before training when too many rows failed, or a file could not be read to its end."""
    figures, limit = record.figures, config.validation.max_bad_fraction
    quarantine = record.dir / "quarantine.jsonl"
    if figures.sources_not_read_to_the_end:
        files = ", ".join(figures.unread_sources[:3]) + (", ..." if len(figures.unread_sources) > 3 else "")
        raise DataQualityError(
            f"{figures.sources_not_read_to_the_end} source file(s) could not be read to the end ({files}); "
            f"training on part of a file is refused: see the quarantine, {quarantine}")
    if figures.bad_fraction <= limit:
        return
    top = ", ".join(f"{code} ({count})" for code, count in list(figures.codes.items())[:3])
    raise DataQualityError(
        f"{figures.rows_quarantined} of {figures.rows_read} rows failed validation "
        f"({figures.bad_fraction:.1%} > validate.max_bad_fraction {limit:.1%}); "
        f"main reasons: {top}; quarantine: {quarantine}"
    )
