"""Classification records: a text and its label, one of `data.labels` (1 in the data matches "1" there)."""

from __future__ import annotations

from typing import Any

from llmops.config.schema import ValidateConfig
from llmops.io.rejects import RejectCode, json_kind
from llmops.records.base import Expect, RecordKind, describe_text


def label_text(label: Any) -> str | None:
    """Labels compare as text, so that 1 in the data matches "1" in data.labels; other types never match."""
    if label is None:
        return None  # reported as missing
    if isinstance(label, bool) or not isinstance(label, str | int):
        return f"<{type(label).__name__}>"
    return str(label)


class ClassificationRecords(RecordKind):
    """A text and its label, one of data.labels."""

    name = "classification"
    fields = ("text", "label")
    label_field = "label"
    text_fields = (("text", True),)
    labelled = True
    # the same text is the same record whatever its label, so that one copy is trained on: a copy labelled
    # otherwise is a conflict
    outside_content = ("label",)

    def expectations(self, expect: Expect, gxe: Any, settings: ValidateConfig, labels: list[str]) -> None:
        super().expectations(expect, gxe, settings, labels)
        expect(gxe.ExpectColumnValuesToNotBeNull(column="_label_type"), RejectCode.MISSING_FIELD, "label")
        expect(gxe.ExpectColumnValuesToBeInSet(column="_label", value_set=labels), RejectCode.LABEL_UNKNOWN, "label")

    def frame(self, chunk: list[dict[str, Any]], labels: list[str]) -> dict[str, list[Any]]:
        columns = super().frame(chunk, labels)
        columns["_label_type"] = [None if row.get("label") is None else json_kind(row.get("label")) for row in chunk]
        columns["_label"] = [label_text(row.get("label")) for row in chunk]
        return columns

    def describe(self, code: RejectCode, field: str, row: dict[str, Any], settings: ValidateConfig,
                 labels: list[str]) -> str:
        if code == RejectCode.LABEL_UNKNOWN:
            return f"label: {row.get('label')!r} is not one of data.labels ({', '.join(labels)})"
        return describe_text(code, field, row.get(field), settings)

    def valid_row(self, row: dict[str, Any], labels: list[str]) -> dict[str, Any]:
        """The label as the declared label it matched (1 in the data is "1" of data.labels): one column type, and
        copies labelled 1 and "1" agree."""
        return row if isinstance(row["label"], str) else {**row, "label": label_text(row["label"])}

    def content(self, row: dict[str, Any]) -> list[str]:
        return [row["text"]]

    def sample(self, row: dict[str, Any]) -> dict[str, Any]:
        return {"text": row["text"], "reference": str(row["label"])}


CLASSIFICATION = ClassificationRecords()
