"""Prompt records: what a model is asked, and optionally the one right answer, for training on rewards (GRPO).

A record's prompt is a string (one user turn, as SFT's instruction) or a list of chat turns ending
with a user turn; its answer, when there is one, is the reference the verifiable rewards compare a
completion with (objectives/rewards.py) and what held-out exact match is scored against. Here: the
column names public datasets use, the checks (the prompt's as a preference prompt's; an answer, if
present, must be non-empty text or a number), and what makes two records duplicates.
"""

from __future__ import annotations

from typing import Any

from llmops.config.schema import ValidateConfig
from llmops.io.rejects import CONTROL, VISIBLE, RejectCode, blank, json_kind
from llmops.records.base import Expect, RecordKind, describe_text
from llmops.records.preference import PROMPT_ROLES, contents, roles, turns_ok
from llmops.records.turns import Messages, prompt_messages

FIELDS = ("prompt", "answer")


class PromptRecords(RecordKind):
    """A prompt (text or chat turns ending with a user turn) and an optional reference answer."""

    name = "prompts"
    fields = FIELDS
    asked_fields = ("prompt",)
    # the column names public prompt datasets use, tried in order when data.columns does not map a field
    columns = {"prompt": ("prompt", "question", "query", "problem", "instruction"),
               "answer": ("answer", "solution", "ground_truth", "reference", "target", "output")}

    def frame(self, chunk: list[dict[str, Any]], labels: list[str]) -> dict[str, list[Any]]:
        prompts = [row.get("prompt") for row in chunk]
        texts = [contents(value) for value in prompts]
        answers = [row.get("answer") for row in chunk]
        return {
            "_prompt_type": [None if value is None else json_kind(value) for value in prompts],
            "_prompt_turns_ok": [not isinstance(value, list) or turns_ok(value) for value in prompts],
            "_prompt_roles": [roles(value, "prompt") for value in prompts],
            "_prompt_empty": [None if t is None else sum(blank(c) for c in t) for t in texts],
            "_prompt_text": [None if t is None else "\n".join(t) for t in texts],
            "_answer_type": [None if value is None else json_kind(value) for value in answers],
            "answer": [answer_text(value) for value in answers],
        }

    def expectations(self, expect: Expect, gxe: Any, settings: ValidateConfig, labels: list[str]) -> None:
        """The prompt's checks, most basic first; then the answer's, when there is one."""
        code, text = RejectCode, "_prompt_text"
        expect(gxe.ExpectColumnValuesToNotBeNull(column="_prompt_type"), code.MISSING_FIELD, "prompt")
        expect(gxe.ExpectColumnValuesToBeInSet(column="_prompt_type", value_set=["string", "array"]),
               code.WRONG_TYPE, "prompt")
        expect(gxe.ExpectColumnValuesToBeInSet(column="_prompt_turns_ok", value_set=[True]), code.CHAT_TURNS,
               "prompt")
        expect(gxe.ExpectColumnValuesToMatchRegex(column="_prompt_roles", regex=PROMPT_ROLES), code.CHAT_ORDER,
               "prompt")
        expect(gxe.ExpectColumnValuesToBeBetween(column="_prompt_empty", max_value=0), code.EMPTY, "prompt")
        if settings.min_chars > 1:
            expect(gxe.ExpectColumnValueLengthsToBeBetween(column=text, min_value=settings.min_chars),
                   code.TOO_SHORT, "prompt")
        expect(gxe.ExpectColumnValuesToNotMatchRegex(column=text, regex="\x00"), code.NUL_BYTE, "prompt")
        expect(gxe.ExpectColumnValuesToNotMatchRegex(column=text, regex=CONTROL), code.CONTROL_CHAR, "prompt")
        expect(gxe.ExpectColumnValueLengthsToBeBetween(column=text, max_value=settings.max_chars), code.TOO_LONG,
               "prompt")
        # the answer is optional; one that is there must be something to compare with
        expect(gxe.ExpectColumnValuesToBeInSet(column="_answer_type", value_set=["string", "number"]),
               code.WRONG_TYPE, "answer")
        expect(gxe.ExpectColumnValuesToMatchRegex(column="answer", regex=VISIBLE), code.EMPTY, "answer")
        expect(gxe.ExpectColumnValuesToNotMatchRegex(column="answer", regex="\x00"), code.NUL_BYTE, "answer")
        expect(gxe.ExpectColumnValuesToNotMatchRegex(column="answer", regex=CONTROL), code.CONTROL_CHAR, "answer")
        expect(gxe.ExpectColumnValueLengthsToBeBetween(column="answer", max_value=settings.max_chars),
               code.TOO_LONG, "answer")

    def describe(self, code: RejectCode, field: str, row: dict[str, Any], settings: ValidateConfig,
                 labels: list[str]) -> str:
        value = row.get(field)
        if field == "answer":
            if code == RejectCode.WRONG_TYPE:
                return f"answer: a {json_kind(value)} where text or a number is expected"
            return describe_text(code, field, answer_text(value), settings)
        texts = contents(value) or []
        details = {
            RejectCode.WRONG_TYPE: f"a {json_kind(value)} where text or a list of chat turns is expected",
            RejectCode.CHAT_TURNS: "not a list of turns with a string role and string content",
            RejectCode.CHAT_ORDER: f"roles {roles(value, 'prompt')!r} are out of order; expected an optional system "
                                   "turn, then user and assistant alternating, ending with user",
            RejectCode.EMPTY: "empty or only whitespace" if isinstance(value, str) else
            f"turn {next((i for i, c in enumerate(texts, 1) if blank(c)), 0)} is empty",
        }
        if code in details:
            return f"prompt: {details[code]}"
        return describe_text(code, "prompt", "\n".join(texts), settings)

    def valid_row(self, row: dict[str, Any], labels: list[str]) -> dict[str, Any]:
        """A numeric answer becomes its text: the rewards and exact match compare text."""
        return {**row, "answer": answer_text(row.get("answer"))}

    def content(self, row: dict[str, Any]) -> list[str]:
        """What makes two records the same: the prompt's turns and the answer."""
        turns = [f"{turn['role']}:{turn['content']}" for turn in prompt_messages(row["prompt"])]
        return [*turns, answer_text(row.get("answer")) or ""]

    def sample(self, row: dict[str, Any]) -> dict[str, Any]:
        return {"prompt": prompt_messages(row["prompt"])[-1]["content"], "reference": answer_text(row.get("answer"))}


PROMPTS = PromptRecords()


# below this a whole float is written with its every digit: past it, digits are no longer exact
EXACT_INTEGERS = 2**53


def answer_text(value: Any) -> str | None:
    """An answer as text, as people write it and exact match compares it: a whole number without a fraction
    (`1e5` and `100000.0` are "100000", `-0.0` is "0"), another number as Python writes it; None for a missing
    answer (or one of another type)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer() and abs(value) < EXACT_INTEGERS:
        return str(int(value))
    if isinstance(value, (int, float)):
        return str(value)
    return value if isinstance(value, str) else None


def messages(row: dict[str, Any]) -> Messages:
    """The prompt as chat turns: a string prompt is one user turn, as SFT renders an instruction."""
    return prompt_messages(row["prompt"])
