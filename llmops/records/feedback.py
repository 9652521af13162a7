"""Feedback records: a prompt, one completion, and whether the completion is desirable (unpaired feedback, for KTO).

A record's prompt is a string (one user turn) or a list of chat turns ending with a user turn; the
completion is a string or one assistant turn, checked as a preference pair's answers are
(records/preference.py); `label` is a JSON boolean, true for a desirable completion and false
for an undesirable one (a thumbs up or down). A row without a label is quarantined as
`missing_field`, a label of another type as `wrong_type`, and an empty completion as `empty`, each
naming the field. Here too: the column names public feedback datasets use, and what makes two
records duplicates (the label included: the same completion judged both ways is kept, twice).
"""

from __future__ import annotations

from typing import Any

from llmops.config.schema import ValidateConfig
from llmops.io.rejects import RejectCode, json_kind
from llmops.records.base import Expect
from llmops.records.preference import TurnRecords
from llmops.records.turns import answer_text, prompt_messages

LABEL_WORDS = {True: "desirable", False: "undesirable"}


class FeedbackRecords(TurnRecords):
    """A prompt, a completion and a boolean label: desirable or not."""

    name = "feedback"
    fields = ("prompt", "completion", "label")
    asked_fields = ("prompt",)
    turn_fields = ("prompt", "completion")
    # the column names public feedback datasets use, for each canonical field, in the order they are tried
    columns = {"prompt": ("prompt", "question", "instruction"),
               "completion": ("completion", "response", "output", "answer"),
               "label": ("label", "desirable", "is_desirable")}

    def frame(self, chunk: list[dict[str, Any]], labels: list[str]) -> dict[str, list[Any]]:
        columns = super().frame(chunk, labels)
        columns["_label_type"] = [None if row.get("label") is None else json_kind(row["label"]) for row in chunk]
        return columns

    def expectations(self, expect: Expect, gxe: Any, settings: ValidateConfig, labels: list[str]) -> None:
        """The prompt's and the completion's checks, then the label's: present, and true or false."""
        super().expectations(expect, gxe, settings, labels)
        expect(gxe.ExpectColumnValuesToNotBeNull(column="_label_type"), RejectCode.MISSING_FIELD, "label")
        expect(gxe.ExpectColumnValuesToBeInSet(column="_label_type", value_set=["boolean"]), RejectCode.WRONG_TYPE,
               "label")

    def describe(self, code: RejectCode, field: str, row: dict[str, Any], settings: ValidateConfig,
                 labels: list[str]) -> str:
        if field != "label":
            return super().describe(code, field, row, settings, labels)
        if code == RejectCode.MISSING_FIELD:
            return "label: missing (expected true for a desirable completion, false for an undesirable one)"
        return (f"label: a {json_kind(row.get('label'))} ({str(row.get('label'))[:20]!r}) where true (desirable) or "
                "false (undesirable) is expected")

    def content(self, row: dict[str, Any]) -> list[str]:
        """What makes two records the same: the prompt's turns, the completion and its label."""
        turns = [f"{turn['role']}:{turn['content']}" for turn in prompt_messages(row["prompt"])]
        return [*turns, answer_text(row["completion"]), LABEL_WORDS[bool(row["label"])]]

    def tokenizer_text(self, row: dict[str, Any]) -> str:
        """What a tokenizer trained here reads: the texts, not the label's word."""
        return "\n".join(self.content(row)[:-1])

    def sample(self, row: dict[str, Any]) -> dict[str, Any]:
        return {"prompt": prompt_messages(row["prompt"])[-1]["content"], "completion": answer_text(row["completion"]),
                "label": LABEL_WORDS[bool(row["label"])]}


FEEDBACK = FeedbackRecords()
