"""Validate: a great-expectations suite per record kind, with a row-level quarantine.

Rows are checked in chunks, so memory stays bounded. Every failing row is written to
`quarantine.jsonl` with its source file, line and reason, next to the rows ingest could not
parse; the good rows go on. Past `max_bad_fraction` the run stops before training.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

from tasks import keys, workspace
from tasks.config import DataConfig, PipelineConfig, RecordKind, ValidateConfig
from tasks.ingest import IngestRecord
from tasks.workspace import Figures, StageRecord

# string fields of each record kind, and whether each is required
STRING_FIELDS: dict[str, tuple[tuple[str, bool], ...]] = {
    "text": (("text", True),),
    "instruction": (("instruction", True), ("input", False), ("output", True)),
    "chat": (),
    "classification": (("text", True),),
}
CHAT_ROLES = r"^(system,)?(user,assistant,)*user,assistant\Z"
EXCERPT_CHARS = 200


class DataQualityError(ValueError):
    """Too many rows failed validation; the message says how many, why and where they are."""


class ValidateFigures(Figures):
    rows_read: int
    rows_kept: int
    rows_quarantined: int
    bad_fraction: float
    reasons: dict[str, int]
    sources_not_read_to_the_end: int


ValidateRecord = StageRecord[ValidateFigures]


def validate(config: PipelineConfig, ingested: IngestRecord) -> ValidateRecord:
    key = keys.key_for("validate", config, [ingested], workspace.project_root())

    def build(folder: Path) -> ValidateFigures:
        stats = split_valid_rows(config.validation, config.data, ingested.dir, folder)
        if stats["rows_read"] != ingested.figures.rows_read:
            raise RuntimeError(f"validate counted {stats['rows_read']} rows, ingest {ingested.figures.rows_read}")
        return ValidateFigures(**stats, sources_not_read_to_the_end=ingested.figures.sources_not_read_to_the_end)

    return workspace.build_artifact(ValidateRecord, "validate", key, build, [ingested])


def split_valid_rows(config: ValidateConfig, data: DataConfig, source: Path, folder: Path) -> dict[str, Any]:
    kind = data.kind
    suite = build_suite(config, kind, data.labels)
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


def build_suite(config: ValidateConfig, kind: RecordKind, labels: list[str]) -> Any:
    """The suite for `kind`; each expectation carries the reason a failing row is given in its meta."""
    import great_expectations as gx

    gx_context()  # suites belong to a context: the ephemeral one, created once per process
    gxe = gx.expectations
    suite = gx.ExpectationSuite(name=f"llmops-{kind}")

    def expect(expectation: Any, reason: str) -> None:
        expectation.meta = {"reason": reason}
        suite.add_expectation(expectation)

    for field, required in STRING_FIELDS[kind]:
        if required:
            expect(gxe.ExpectColumnValuesToNotBeNull(column=field), f"{field}: missing")
            expect(gxe.ExpectColumnValuesToMatchRegex(column=field, regex=r"\S"), f"{field}: empty or only whitespace")
            if config.min_chars > 1:
                expect(gxe.ExpectColumnValueLengthsToBeBetween(column=field, min_value=config.min_chars),
                       f"{field}: shorter than {config.min_chars} characters")
        expect(gxe.ExpectColumnValuesToBeOfType(column=field, type_="str"), f"{field}: not a string")
        expect(gxe.ExpectColumnValuesToNotMatchRegex(column=field, regex="\x00"), f"{field}: contains a NUL byte")
        expect(gxe.ExpectColumnValueLengthsToBeBetween(column=field, max_value=config.max_chars),
               f"{field}: longer than {config.max_chars} characters")
    if kind == "classification":
        expect(gxe.ExpectColumnValuesToNotBeNull(column="label"), "label: missing")
        expect(gxe.ExpectColumnValuesToBeInSet(column="_label", value_set=labels),
               f"label: not one of the declared labels ({', '.join(labels)})")
    if kind == "chat":
        expect(gxe.ExpectColumnValuesToNotBeNull(column="messages"), "messages: missing")
        expect(gxe.ExpectColumnValuesToBeInSet(column="_turns_ok", value_set=[True]),
               "messages: not a list of turns with a string role and string content")
        expect(gxe.ExpectColumnValuesToMatchRegex(column="_roles", regex=CHAT_ROLES),
               "messages: roles must be an optional system turn, then user and assistant alternating, "
               "ending with assistant")
        expect(gxe.ExpectColumnValuesToBeBetween(column="_empty_turns", max_value=0),
               "messages: a turn is empty or only whitespace")
        expect(gxe.ExpectColumnValuesToBeInSet(column="_nul", value_set=[False]), "messages: contains a NUL byte")
        expect(gxe.ExpectColumnValuesToBeBetween(column="_chars", max_value=config.max_chars),
               f"messages: longer than {config.max_chars} characters")
    return suite


def chunk_frame(chunk: list[dict[str, Any]], kind: RecordKind) -> Any:
    """The chunk's fields, plus columns derived for checks that look inside a value (chat turns, labels)."""
    import pandas as pd

    columns: dict[str, list[Any]] = {field: [row.get(field) for row in chunk] for field, _ in STRING_FIELDS[kind]}
    if kind == "classification":
        columns["label"] = [row.get("label") for row in chunk]
        columns["_label"] = [label_text(row.get("label")) for row in chunk]
    if kind == "chat":
        turns = [chat_summary(row.get("messages")) for row in chunk]
        columns["messages"] = [row.get("messages") for row in chunk]
        for name in ("_turns_ok", "_roles", "_empty_turns", "_nul", "_chars"):
            columns[name] = [summary[name] for summary in turns]
    return pd.DataFrame({name: pd.Series(values, dtype=object) for name, values in columns.items()})


def label_text(label: Any) -> str | None:
    """Labels compare as text, so that 1 in the data matches "1" in data.labels; other types never match."""
    if label is None:
        return None  # reported as missing
    if isinstance(label, bool) or not isinstance(label, str | int):
        return f"<{type(label).__name__}>"
    return str(label)


def chat_summary(messages: Any) -> dict[str, Any]:
    turns_ok = isinstance(messages, list) and bool(messages) and all(
        isinstance(t, dict) and isinstance(t.get("role"), str) and isinstance(t.get("content"), str) for t in messages)
    if not turns_ok:
        return {"_turns_ok": messages is None, "_roles": None, "_empty_turns": None, "_nul": None, "_chars": None}
    contents = [turn["content"] for turn in messages]
    return {"_turns_ok": True, "_roles": ",".join(turn["role"] for turn in messages),
            "_empty_turns": sum(not c.strip() for c in contents), "_nul": any("\x00" in c for c in contents),
            "_chars": sum(len(c) for c in contents)}


def failing_rows(suite: Any, chunk: list[dict[str, Any]], kind: RecordKind) -> dict[int, list[str]]:
    """Run the suite on one chunk; map each failing row's index to its reasons."""
    batch = batch_definition().get_batch(batch_parameters={"dataframe": chunk_frame(chunk, kind)})
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


def check_bad_fraction(config: PipelineConfig, record: ValidateRecord) -> None:
    """Stop the run before training when too many rows failed, or a file could not be read to its end."""
    figures, limit = record.figures, config.validation.max_bad_fraction
    if figures.sources_not_read_to_the_end:
        raise DataQualityError(
            f"{figures.sources_not_read_to_the_end} source file(s) could not be read to the end (a broken JSON "
            f"array); training on part of a file is refused: see the quarantine, {record.dir / 'quarantine.jsonl'}")
    if figures.bad_fraction <= limit:
        return
    top = ", ".join(f"{reason} ({count})" for reason, count in list(figures.reasons.items())[:3])
    raise DataQualityError(
        f"{figures.rows_quarantined} of {figures.rows_read} rows failed validation "
        f"({figures.bad_fraction:.1%} > validate.max_bad_fraction {limit:.1%}); "
        f"main reasons: {top}; quarantine: {record.dir / 'quarantine.jsonl'}"
    )
