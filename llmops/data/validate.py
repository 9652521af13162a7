"""Validate: a great-expectations suite per record kind, with a row-level quarantine.

Rows are checked in chunks, so memory stays bounded. Every failing row is written to
`quarantine.jsonl` with its source file, line, reject code, field and a message, next to the rows
ingest could not read; the good rows go on. Past `max_bad_fraction` the run stops before training.
"""

from __future__ import annotations

import functools
import json
import re
from collections import Counter
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

from llmops.core import keys, workspace
from llmops.core.config import DataConfig, PipelineConfig, RecordKind, ValidateConfig
from llmops.core.rejects import CONTROL, RejectCode, json_kind, sorted_counts
from llmops.core.workspace import Figures, StageRecord
from llmops.data.ingest import IngestRecord
from llmops.objectives import preference, token_classification

# string fields of each record kind, and whether each is required
STRING_FIELDS: dict[str, tuple[tuple[str, bool], ...]] = {
    "text": (("text", True),),
    "instruction": (("instruction", True), ("input", False), ("output", True)),
    "chat": (),
    "classification": (("text", True),),
    "tokens": (),
    "preference": (),
    "seq2seq": (("source", True), ("target", True)),
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
    # quarantined rows per reject code (each row counted once, by its first failure): metrics `validate.codes.<code>`
    codes: dict[RejectCode, int]
    sources_not_read_to_the_end: int
    unread_sources: list[str]

    NAMED_MAPS = ("codes",)


ValidateRecord = StageRecord[ValidateFigures]


def validate(config: PipelineConfig, ingested: IngestRecord) -> ValidateRecord:
    key = keys.key_for("validate", config, [ingested], workspace.project_root())

    def build(folder: Path) -> ValidateFigures:
        stats = split_valid_rows(config.validation, config.data, ingested.dir, folder)
        if stats["rows_read"] != ingested.figures.rows_read:
            raise RuntimeError(f"validate counted {stats['rows_read']} rows, ingest {ingested.figures.rows_read}")
        return ValidateFigures(**stats, sources_not_read_to_the_end=ingested.figures.sources_not_read_to_the_end,
                               unread_sources=ingested.figures.unread_sources)

    return workspace.build_artifact(ValidateRecord, "validate", key, build, [ingested])


def split_valid_rows(config: ValidateConfig, data: DataConfig, source: Path, folder: Path) -> dict[str, Any]:
    kind = data.kind
    suite = build_suite(config, kind, data.labels)
    codes: Counter[RejectCode] = Counter()
    kept = 0
    with (folder / "valid.jsonl").open("w", encoding="utf-8") as good, \
         (folder / "quarantine.jsonl").open("w", encoding="utf-8") as bad:
        for row in workspace.read_jsonl(source / "rejected.jsonl"):
            bad.write(json.dumps(row, ensure_ascii=False) + "\n")
            codes[RejectCode(row["code"])] += 1
        for chunk in read_chunks(source / "records.jsonl", config.chunk_rows):
            failures = failing_rows(suite, chunk, kind, data.labels)
            for index, row in enumerate(chunk):
                if index in failures:
                    entry = quarantine_entry(row, failures[index], config, data.labels)
                    bad.write(json.dumps(entry, ensure_ascii=False) + "\n")
                    codes[RejectCode(entry["code"])] += 1
                else:
                    row = token_classification.named_tags(row, data.labels) if kind == "tokens" else row
                    good.write(json.dumps(row, ensure_ascii=False) + "\n")
                    kept += 1
    quarantined = sum(codes.values())
    rows_read = kept + quarantined
    return {"rows_read": rows_read, "rows_kept": kept, "rows_quarantined": quarantined,
            "bad_fraction": quarantined / rows_read if rows_read else 0.0, "codes": sorted_counts(codes)}


def read_chunks(path: Path, size: int) -> Iterator[list[dict[str, Any]]]:
    rows = iter(workspace.read_jsonl(path))
    while chunk := list(islice(rows, size)):
        yield chunk


def quarantine_entry(row: dict[str, Any], failures: list[tuple[RejectCode, str]], config: ValidateConfig,
                     labels: list[str]) -> dict[str, Any]:
    """The row's first failure gives its code and field; the message names every failure, with the detail."""
    content = {k: v for k, v in row.items() if not k.startswith("_")}
    code, field = failures[0]
    message = "; ".join(describe(c, f, row, config, labels) for c, f in failures)
    return {"source": row["_source"], "line": row["_line"], "code": code.value, "field": field, "message": message,
            "excerpt": json.dumps(content, ensure_ascii=False)[:EXCERPT_CHARS]}


def describe(code: RejectCode, field: str, row: dict[str, Any], config: ValidateConfig, labels: list[str]) -> str:
    """A person's reading of one failure of one row."""
    value = row.get(field)
    if field in ("tokens", "tags"):
        return token_classification.describe(code, field, row, labels, config.max_chars)
    if field in preference.FIELDS:
        return preference.describe(code, field, row, config.min_chars, config.max_chars)
    if field == "messages" and code not in (RejectCode.MISSING_FIELD, RejectCode.CHAT_TURNS):
        return describe_chat(code, value, config)
    details = {
        RejectCode.MISSING_FIELD: "missing",
        RejectCode.WRONG_TYPE: f"a {json_kind(value)} where text is expected",
        RejectCode.EMPTY: "empty or only whitespace",
        RejectCode.TOO_SHORT: f"{length(value)} characters, under validate.min_chars ({config.min_chars})",
        RejectCode.TOO_LONG: f"{length(value)} characters, over validate.max_chars ({config.max_chars})",
        RejectCode.NUL_BYTE: f"a NUL character at position {first_match(chr(0), value)}",
        RejectCode.CONTROL_CHAR: f"a control character ({control_name(value)})",
        RejectCode.LABEL_UNKNOWN: f"{value!r} is not one of data.labels ({', '.join(labels)})",
        RejectCode.CHAT_TURNS: turns_problem(value),
    }
    return f"{field}: {details.get(code, code.value)}"


def describe_chat(code: RejectCode, messages: list[dict[str, Any]], config: ValidateConfig) -> str:
    contents = [turn["content"] for turn in messages]
    if code == RejectCode.CHAT_ORDER:
        roles = ", ".join(turn["role"] for turn in messages)
        return (f"messages: roles {roles!r} are out of order; expected an optional system turn, then user and "
                "assistant alternating, ending with assistant")
    if code == RejectCode.EMPTY:
        return f"messages: turn {next(i for i, c in enumerate(contents, 1) if not c.strip())} is empty"
    if code == RejectCode.TOO_LONG:
        return f"messages: {sum(map(len, contents))} characters, over validate.max_chars ({config.max_chars})"
    nul = code == RejectCode.NUL_BYTE
    turn = next(i for i, c in enumerate(contents, 1) if re.search(chr(0) if nul else CONTROL, c))
    what = "a NUL character" if nul else f"a control character ({control_name(contents[turn - 1])})"
    return f"messages: turn {turn} holds {what}"


def length(value: Any) -> int:
    return len(value) if isinstance(value, str) else 0


def first_match(pattern: str, value: Any) -> int:
    found = re.search(pattern, value) if isinstance(value, str) else None
    return found.start() if found else -1


def control_name(value: Any) -> str:
    found = re.search(CONTROL, value) if isinstance(value, str) else None
    return f"U+{ord(found.group()):04X} at position {found.start()}" if found else "?"


def turns_problem(messages: Any) -> str:
    if not isinstance(messages, list):
        return f"a {json_kind(messages)} where a list of turns is expected"
    if not messages:
        return "an empty list of turns"
    for number, turn in enumerate(messages, 1):
        if not isinstance(turn, dict):
            return f"turn {number} is a {json_kind(turn)}, not an object with role and content"
        for key in ("role", "content"):
            if not isinstance(turn.get(key), str):
                return f"turn {number}: {key} is a {json_kind(turn.get(key))}, not text"
    return "not a list of turns with a string role and string content"


@functools.cache
def gx_context() -> Any:
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    return context


def build_suite(config: ValidateConfig, kind: RecordKind, labels: list[str]) -> Any:
    """The suite for `kind`, most basic checks first; each expectation carries its reject code and field."""
    import great_expectations as gx

    gx_context()  # suites belong to a context: the ephemeral one, created once per process
    gxe = gx.expectations
    suite = gx.ExpectationSuite(name=f"llmops-{kind}")
    code = RejectCode

    def expect(expectation: Any, reject: RejectCode, field: str) -> None:
        expectation.meta = {"code": reject.value, "field": field}
        suite.add_expectation(expectation)

    for field, required in STRING_FIELDS[kind]:
        if required:
            expect(gxe.ExpectColumnValuesToNotBeNull(column=f"_{field}_type"), code.MISSING_FIELD, field)
        expect(gxe.ExpectColumnValuesToBeInSet(column=f"_{field}_type", value_set=["string"]), code.WRONG_TYPE, field)
        if required:
            expect(gxe.ExpectColumnValuesToMatchRegex(column=field, regex=r"\S"), code.EMPTY, field)
            if config.min_chars > 1:
                expect(gxe.ExpectColumnValueLengthsToBeBetween(column=field, min_value=config.min_chars),
                       code.TOO_SHORT, field)
        expect(gxe.ExpectColumnValuesToNotMatchRegex(column=field, regex="\x00"), code.NUL_BYTE, field)
        expect(gxe.ExpectColumnValuesToNotMatchRegex(column=field, regex=CONTROL), code.CONTROL_CHAR, field)
        expect(gxe.ExpectColumnValueLengthsToBeBetween(column=field, max_value=config.max_chars), code.TOO_LONG,
               field)
    if kind == "classification":
        expect(gxe.ExpectColumnValuesToNotBeNull(column="_label_type"), code.MISSING_FIELD, "label")
        expect(gxe.ExpectColumnValuesToBeInSet(column="_label", value_set=labels), code.LABEL_UNKNOWN, "label")
    if kind == "tokens":
        token_classification.add_expectations(expect, gxe, config.max_chars)
    if kind == "chat":
        expect(gxe.ExpectColumnValuesToNotBeNull(column="_messages_type"), code.MISSING_FIELD, "messages")
        expect(gxe.ExpectColumnValuesToBeInSet(column="_turns_ok", value_set=[True]), code.CHAT_TURNS, "messages")
        expect(gxe.ExpectColumnValuesToMatchRegex(column="_roles", regex=CHAT_ROLES), code.CHAT_ORDER, "messages")
        expect(gxe.ExpectColumnValuesToBeBetween(column="_empty_turns", max_value=0), code.EMPTY, "messages")
        expect(gxe.ExpectColumnValuesToBeInSet(column="_nul", value_set=[False]), code.NUL_BYTE, "messages")
        expect(gxe.ExpectColumnValuesToBeInSet(column="_control", value_set=[False]), code.CONTROL_CHAR, "messages")
        expect(gxe.ExpectColumnValuesToBeBetween(column="_chars", max_value=config.max_chars), code.TOO_LONG,
               "messages")
    if kind == "preference":
        preference.add_expectations(expect, gxe, config.min_chars, config.max_chars)
    return suite


def chunk_frame(chunk: list[dict[str, Any]], kind: RecordKind, labels: list[str] | None = None) -> Any:
    """Columns the expectations can read whatever a row holds: each checked field's JSON type (None when it is
    missing), its text (None when it is not text: lists and objects break column checks), and columns derived
    for checks that look inside a value (chat turns, labels)."""
    import pandas as pd

    columns: dict[str, list[Any]] = {}
    for field in [name for name, _ in STRING_FIELDS[kind]] + {"classification": ["label"], "chat": ["messages"]
                                                               }.get(kind, []):
        values = [row.get(field) for row in chunk]
        columns[f"_{field}_type"] = [None if value is None else json_kind(value) for value in values]
        if field not in ("label", "messages"):
            columns[field] = [value if isinstance(value, str) else None for value in values]
    if kind == "classification":
        columns["_label"] = [label_text(row.get("label")) for row in chunk]
    if kind == "chat":
        turns = [chat_summary(row.get("messages")) for row in chunk]
        for name in ("_turns_ok", "_roles", "_empty_turns", "_nul", "_control", "_chars"):
            columns[name] = [summary[name] for summary in turns]
    if kind == "tokens":
        columns.update(token_classification.frame_columns(chunk, labels or []))
    if kind == "preference":
        columns.update(preference.frame_columns(chunk))
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
        return {"_turns_ok": messages is None, "_roles": None, "_empty_turns": None, "_nul": None,
                "_control": None, "_chars": None}
    contents = [turn["content"] for turn in messages]
    return {"_turns_ok": True, "_roles": ",".join(turn["role"] for turn in messages),
            "_empty_turns": sum(not c.strip() for c in contents), "_nul": any("\x00" in c for c in contents),
            "_control": any(re.search(CONTROL, c) for c in contents), "_chars": sum(len(c) for c in contents)}


def failing_rows(suite: Any, chunk: list[dict[str, Any]], kind: RecordKind,
                 labels: list[str] | None = None) -> dict[int, list[tuple[RejectCode, str]]]:
    """Run the suite on one chunk; map each failing row's index to its (code, field) failures, in suite order."""
    batch = batch_definition().get_batch(batch_parameters={"dataframe": chunk_frame(chunk, kind, labels)})
    result = batch.validate(suite, result_format={"result_format": "COMPLETE"})
    rank = {(e.meta["code"], e.meta["field"]): order for order, e in enumerate(suite.expectations)}
    failures: dict[int, list[tuple[RejectCode, str]]] = {}
    for outcome in result.results:
        if outcome.success:
            continue
        raised = (outcome.exception_info or {}).get("raised_exception")
        if raised:
            raise RuntimeError(f"validation could not run {outcome.expectation_config.type}: "
                               f"{outcome.exception_info.get('exception_message')}")
        for index in outcome.result.get("unexpected_index_list") or []:
            meta = outcome.expectation_config.meta
            failures.setdefault(int(index), []).append((RejectCode(meta["code"]), meta["field"]))
    # results come grouped by metric, not in suite order: the most basic failure of a row comes first
    return {index: sorted(found, key=lambda failure: rank[(failure[0].value, failure[1])])
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
