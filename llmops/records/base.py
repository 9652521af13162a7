"""Record kinds: the shape of a record, the columns public datasets give its fields, its checks, its content.

A record kind is what the data stages need to know: ingest maps a source's columns to the kind's
fields, validation runs the kind's expectations (great-expectations, each with a reject code and a
field) over columns the kind derives from a chunk of rows, dedup compares the kind's content, and a
tokenizer trained here reads the kind's text. Most kinds are text fields with checks in common
(present, a string, not empty, no NUL or control character, not too long); the base class gives
those, and kinds with lists of turns, words or answers add their own.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from llmops.config.schema import DataConfig, ValidateConfig
from llmops.io.rejects import CONTROL, VISIBLE, RejectCode, json_kind

# `expect(expectation, code, field)`: adds a great-expectations expectation that rejects rows with `code`
Expect = Any
# a problem with a config, as (the field at fault, what to change)
Problem = tuple[str, str]


class RecordKind:
    """A kind of record; subclasses set the class attributes and override what their fields need."""

    name: ClassVar[str]
    fields: ClassVar[tuple[str, ...]]
    # canonical field -> the column names public datasets use for it, tried in order when data.columns does not map
    # it (a field without an entry is read from the column of its own name)
    columns: ClassVar[dict[str, tuple[str, ...]]] = {}
    # fields checked as text, each with whether it is required
    text_fields: ClassVar[tuple[tuple[str, bool], ...]] = ()
    # the kind reads data.labels (a label per row, a tag per word): it needs at least two
    labelled: ClassVar[bool] = False
    # reject codes of the kind's own, beside the shared ones (io/rejects.py), with what each means
    reject_codes: ClassVar[dict[str, str]] = {}
    # fields `content` leaves out that two copies of a record may disagree on (a classification's label): a copy
    # dedup removes that disagrees with the one it keeps is a conflict, counted and listed
    outside_content: ClassVar[tuple[str, ...]] = ()
    # what a model is asked of a record, without its answer (monitoring compares served requests with these);
    # empty: the text fields
    asked_fields: ClassVar[tuple[str, ...]] = ()
    # the field holding the answer a classifier gives (its predicted labels are compared with the data's)
    label_field: ClassVar[str | None] = None
    # fields that hold tools a conversation may call: data with one of them needs a chat template that renders tools
    tool_columns: ClassVar[tuple[str, ...]] = ()

    # --- ingest --------------------------------------------------------------------------------------------

    def source_columns(self, mapped: dict[str, str]) -> set[str]:
        """Every column a source may hold one of the kind's fields in."""
        return {name for field in self.fields
                for name in ((mapped[field],) if field in mapped else self.columns.get(field, (field,)))}

    def canonical(self, row: dict[str, Any], mapped: dict[str, str]) -> dict[str, Any]:
        """The record's fields: each from its mapped column, else from the first of its common column names that
        holds a value; values are kept as they are (validation judges them)."""
        return {field: row.get(mapped[field]) if field in mapped else
                next((row[name] for name in self.columns.get(field, (field,)) if row.get(name) is not None), None)
                for field in self.fields}

    # --- validate ------------------------------------------------------------------------------------------

    def expectations(self, expect: Expect, gxe: Any, settings: ValidateConfig, labels: list[str]) -> None:
        """The kind's checks, most basic first; each carries its reject code and field."""
        code = RejectCode
        for field, required in self.text_fields:
            if required:
                expect(gxe.ExpectColumnValuesToNotBeNull(column=f"_{field}_type"), code.MISSING_FIELD, field)
            expect(gxe.ExpectColumnValuesToBeInSet(column=f"_{field}_type", value_set=["string"]), code.WRONG_TYPE,
                   field)
            if required:
                expect(gxe.ExpectColumnValuesToMatchRegex(column=field, regex=VISIBLE), code.EMPTY, field)
                if settings.min_chars > 1:
                    expect(gxe.ExpectColumnValueLengthsToBeBetween(column=field, min_value=settings.min_chars),
                           code.TOO_SHORT, field)
            expect(gxe.ExpectColumnValuesToNotMatchRegex(column=field, regex="\x00"), code.NUL_BYTE, field)
            expect(gxe.ExpectColumnValuesToNotMatchRegex(column=field, regex=CONTROL), code.CONTROL_CHAR, field)
            expect(gxe.ExpectColumnValueLengthsToBeBetween(column=field, max_value=settings.max_chars),
                   code.TOO_LONG, field)

    def frame(self, chunk: list[dict[str, Any]], labels: list[str]) -> dict[str, list[Any]]:
        """Columns the expectations can read whatever a row holds: each text field's JSON type (None when it is
        missing) and its text (None when it is not text: lists and objects break column checks)."""
        columns: dict[str, list[Any]] = {}
        for field, _ in self.text_fields:
            values = [row.get(field) for row in chunk]
            columns[f"_{field}_type"] = [None if value is None else json_kind(value) for value in values]
            columns[field] = [value if isinstance(value, str) else None for value in values]
        return columns

    def describe(self, code: RejectCode, field: str, row: dict[str, Any], settings: ValidateConfig,
                 labels: list[str]) -> str:
        """A person's reading of one failure of one row."""
        return describe_text(code, field, row.get(field), settings)

    def valid_row(self, row: dict[str, Any], labels: list[str]) -> dict[str, Any]:
        """A row that passed validation, as the later stages read it."""
        return row

    # --- dedup, tokenizer, samples -------------------------------------------------------------------------

    def content(self, row: dict[str, Any]) -> list[str]:
        """What makes two records the same: what the model reads and learns, field by field."""
        return [row.get(field) or "" for field, _ in self.text_fields]

    def asked(self, row: dict[str, Any]) -> str:
        """The text a model reads of a request in this kind's shape, or of a chat request (`messages`), which any
        generative version answers: a chat's last assistant turn is its answer, not what it was asked."""
        if isinstance(row.get("messages"), list):
            turns = row["messages"]
            if turns and isinstance(turns[-1], dict) and turns[-1].get("role") == "assistant":
                turns = turns[:-1]
            return "\n".join(texts_of(turns))
        names = self.asked_fields or tuple(field for field, _ in self.text_fields)
        return "\n".join(text for name in names for text in texts_of(row.get(name)))

    def answered(self, row: dict[str, Any]) -> str:
        """The rest of a record beside what it asks: its answer, label or target (a chat's last assistant turn)."""
        if isinstance(row.get("messages"), list):
            last = row["messages"][-1] if row["messages"] else None
            return last["content"] if isinstance(last, dict) and last.get("role") == "assistant" and \
                isinstance(last.get("content"), str) else ""
        names = self.asked_fields or tuple(field for field, _ in self.text_fields)
        return "\n".join(text for name in self.fields if name not in names for text in texts_of(row.get(name)))

    def corrected(self, messages: list[dict[str, Any]], correction: str) -> tuple[str, dict[str, Any]]:
        """A chat request with the answer it should have had, as a row (its kind's name, the row): a chat row,
        unless this kind holds such a request itself."""
        return "chat", {"messages": [*messages, {"role": "assistant", "content": correction}]}

    def tokenizer_text(self, row: dict[str, Any]) -> str:
        """What a tokenizer trained here reads of a record."""
        return "\n".join(self.content(row))

    def sample(self, row: dict[str, Any]) -> dict[str, Any]:
        """A held-out row as a person reads it next to the models' answers."""
        return {field: row.get(field) for field, _ in self.text_fields}

    def check(self, data: DataConfig) -> list[Problem]:
        problems = [(f"data.sources.{index}.columns", f"{field!r} is not a field of kind {self.name}; its fields: "
                     f"{', '.join(self.fields)}")
                    for index, source in enumerate([*data.sources, *data.eval_sources])
                    for field in source.columns if field not in self.fields]
        if self.labelled and len(data.labels) < 2:
            problems.append(("data.labels", f"kind {self.name} needs data.labels, the list of at least two "
                                            f"{'tags (e.g. O, B-PER, I-PER)' if 'tags' in self.fields else 'labels'}"))
        return problems


def describe_text(code: RejectCode, field: str, value: Any, settings: ValidateConfig) -> str:
    """A text field's failure, with the detail: which character where, how long."""
    details = {
        RejectCode.MISSING_FIELD: "missing",
        RejectCode.WRONG_TYPE: f"a {json_kind(value)} where text is expected",
        RejectCode.EMPTY: "empty or only whitespace",
        RejectCode.TOO_SHORT: f"{length(value)} characters, under validate.min_chars ({settings.min_chars})",
        RejectCode.TOO_LONG: f"{length(value)} characters, over validate.max_chars ({settings.max_chars})",
        RejectCode.NUL_BYTE: f"a NUL character at position {first_match(chr(0), value)}",
        RejectCode.CONTROL_CHAR: f"a control character ({control_name(value)})",
    }
    return f"{field}: {details.get(code, str(code))}"


def texts_of(value: Any) -> list[str]:
    """The texts of a field: a string, each turn's content, a list of words as one text, a label as text."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, bool | int | float):
        return [str(value)]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return [" ".join(value)] if value else []
    if isinstance(value, list):
        return [turn["content"] for turn in value if isinstance(turn, dict) and isinstance(turn.get("content"), str)]
    return []


def length(value: Any) -> int:
    return len(value) if isinstance(value, str) else 0


def first_match(pattern: str, value: Any) -> int:
    found = re.search(pattern, value) if isinstance(value, str) else None
    return found.start() if found else -1


def control_name(value: Any) -> str:
    found = re.search(CONTROL, value) if isinstance(value, str) else None
    return f"U+{ord(found.group()):04X} at position {found.start()}" if found else "?"


class TextRecords(RecordKind):
    """Plain text: a document per record."""

    name = "text"
    fields = ("text",)
    text_fields = (("text", True),)


TEXT = TextRecords()
