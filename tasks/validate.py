"""Validate: a great-expectations suite per record kind, with a row-level quarantine.

Rows are checked in chunks, so memory stays bounded. Every failing row is written to
`quarantine.jsonl` with its source file, line and reason, next to the rows ingest could not
parse; the good rows go on. Past `max_bad_fraction` the run stops before training.
"""

from __future__ import annotations

import functools
import json
import sys
from collections import Counter
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import pandas as pd
from prefect import task
from prefect.cache_policies import NO_CACHE

from flows.config import PipelineConfig, RecordKind, ValidateConfig
from tasks import tracking, workspace
from tasks.tracking import RunHandle
from tasks.workspace import StageRecord

REQUIRED = {"text": ("text",), "instruction": ("instruction", "output")}
OPTIONAL = {"text": (), "instruction": ("input",)}
EXCERPT_CHARS = 200


class DataQualityError(ValueError):
    """Too many rows failed validation; the message says how many, why and where they are."""


def validate(config: ValidateConfig, kind: RecordKind, ingested: StageRecord) -> StageRecord:
    # the threshold does not change the artifact, only whether the run goes on
    relevant = config.model_dump(exclude={"max_bad_fraction"})
    key = workspace.stage_key("validate", relevant, [ingested], workspace.code_version(sys.modules[__name__]),
                              kind=kind)

    def build(folder: Path) -> tuple[str, dict[str, Any]]:
        stats = split_valid_rows(config, kind, ingested.dir, folder)
        assert stats["rows_read"] == ingested.stats["rows_read"], "validate lost rows"
        return workspace.hash_file(folder / "valid.jsonl"), stats

    return workspace.build_artifact("validate", key, build)


def split_valid_rows(config: ValidateConfig, kind: RecordKind, source: Path, folder: Path) -> dict[str, Any]:
    suite = build_suite(config, kind)
    reasons: Counter[str] = Counter()
    kept = quarantined = 0
    with (folder / "valid.jsonl").open("w", encoding="utf-8") as good, \
         (folder / "quarantine.jsonl").open("w", encoding="utf-8") as bad:
        for row in workspace.read_jsonl(source / "rejected.jsonl"):
            bad.write(json.dumps(row, ensure_ascii=False) + "\n")
            reasons[row["reason"]] += 1
            quarantined += 1
        for chunk in read_chunks(source / "records.jsonl", config.chunk_rows):
            failures = failing_rows(suite, chunk, kind)
            for index, row in enumerate(chunk):
                if index in failures:
                    reason = "; ".join(failures[index])
                    bad.write(json.dumps(quarantine_entry(row, reason), ensure_ascii=False) + "\n")
                    reasons.update(failures[index])
                    quarantined += 1
                else:
                    good.write(json.dumps(row, ensure_ascii=False) + "\n")
                    kept += 1
    rows_read = kept + quarantined
    return {"rows_read": rows_read, "rows_kept": kept, "rows_quarantined": quarantined,
            "bad_fraction": quarantined / rows_read if rows_read else 0.0,
            "reasons": dict(reasons.most_common())}


def read_chunks(path: Path, size: int) -> Iterator[list[dict[str, Any]]]:
    rows = iter(workspace.read_jsonl(path))
    while chunk := list(islice(rows, size)):
        yield chunk


def quarantine_entry(row: dict[str, Any], reason: str) -> dict[str, Any]:
    content = {k: v for k, v in row.items() if not k.startswith("_")}
    return {"source": row["_source"], "line": row["_line"], "reason": reason,
            "excerpt": json.dumps(content, ensure_ascii=False)[:EXCERPT_CHARS]}


@functools.cache
def gx_context() -> Any:
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    return context


def build_suite(config: ValidateConfig, kind: RecordKind) -> Any:
    """The suite for `kind`; each expectation carries the reason a failing row is given in its meta."""
    import great_expectations as gx

    gx_context()  # suites belong to a context: the ephemeral one, created once per process
    gxe = gx.expectations
    suite = gx.ExpectationSuite(name=f"llmops-{kind}")

    def expect(expectation: Any, reason: str) -> None:
        expectation.meta = {"reason": reason}
        suite.add_expectation(expectation)

    for field in REQUIRED[kind]:
        expect(gxe.ExpectColumnValuesToNotBeNull(column=field), f"{field}: missing")
        expect(gxe.ExpectColumnValuesToMatchRegex(column=field, regex=r"\S"), f"{field}: empty or only whitespace")
    for field in REQUIRED[kind] + OPTIONAL[kind]:
        expect(gxe.ExpectColumnValuesToBeOfType(column=field, type_="str"), f"{field}: not a string")
        expect(gxe.ExpectColumnValuesToNotMatchRegex(column=field, regex="\x00"), f"{field}: contains a NUL byte")
        expect(gxe.ExpectColumnValueLengthsToBeBetween(column=field, max_value=config.max_chars),
               f"{field}: longer than {config.max_chars} characters")
    for field in REQUIRED[kind]:
        if config.min_chars > 1:
            expect(gxe.ExpectColumnValueLengthsToBeBetween(column=field, min_value=config.min_chars),
                   f"{field}: shorter than {config.min_chars} characters")
    return suite


def failing_rows(suite: Any, chunk: list[dict[str, Any]], kind: RecordKind) -> dict[int, list[str]]:
    """Run the suite on one chunk; map each failing row's index to its reasons."""
    columns = REQUIRED[kind] + OPTIONAL[kind]
    frame = pd.DataFrame({c: pd.Series([row.get(c) for row in chunk], dtype=object) for c in columns})
    batch = batch_definition().get_batch(batch_parameters={"dataframe": frame})
    result = batch.validate(suite, result_format={"result_format": "COMPLETE"})
    failures: dict[int, list[str]] = {}
    for outcome in result.results:
        if outcome.success:
            continue
        raised = (outcome.exception_info or {}).get("raised_exception")
        if raised:
            raise RuntimeError(f"validation could not run {outcome.expectation_config.type}: "
                               f"{outcome.exception_info.get('exception_message')}")
        for index in outcome.result.get("unexpected_index_list") or []:
            failures.setdefault(int(index), []).append(outcome.expectation_config.meta["reason"])
    return failures


@functools.cache
def batch_definition() -> Any:
    source = gx_context().data_sources.add_pandas("llmops")
    return source.add_dataframe_asset("records").add_batch_definition_whole_dataframe("chunk")


def check_bad_fraction(record: StageRecord, limit: float) -> None:
    stats = record.stats
    if stats["bad_fraction"] <= limit:
        return
    top = ", ".join(f"{reason} ({count})" for reason, count in list(stats["reasons"].items())[:3])
    raise DataQualityError(
        f"{stats['rows_quarantined']} of {stats['rows_read']} rows failed validation "
        f"({stats['bad_fraction']:.1%} > validate.max_bad_fraction {limit:.1%}); "
        f"main reasons: {top}; quarantine: {record.dir / 'quarantine.jsonl'}"
    )


@task(name="validate", cache_policy=NO_CACHE)
def validate_task(config: PipelineConfig, ingested: StageRecord, run: RunHandle) -> StageRecord:
    record = tracking.tracked(run, lambda: validate(config.validation, config.data.kind, ingested))
    tracking.log_file(run, record.dir / "quarantine.jsonl", "data")
    check_bad_fraction(record, config.validation.max_bad_fraction)
    return record
