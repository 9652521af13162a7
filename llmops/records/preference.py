"""Preference records: a prompt with a preferred (chosen) and a dispreferred (rejected) answer.

A record's prompt is a string (one user turn) or a list of chat turns ending with a user turn;
each answer is a string or one assistant turn. Here: the common column names public preference
datasets use, the validation checks (with `same_answers` for a pair that prefers nothing), what
makes two pairs duplicates, and the checks of prompts and answers that feedback records share
(records/feedback.py). The held-out metrics every preference objective reports are DPO's
(objectives/dpo.py; ORPO: objectives/orpo.py).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from llmops.config.schema import ValidateConfig
from llmops.io.rejects import CONTROL, RejectCode, blank, json_kind
from llmops.records.base import Expect, RecordKind
from llmops.records.conversations import role_sequence
from llmops.records.turns import Messages, answer_text, prompt_messages

FIELDS = ("prompt", "chosen", "rejected")
# the roles of a conversational prompt (it ends where the answer starts) and of an answer
PROMPT_ROLES = r"^(system,)?(user,assistant,)*user\Z"
ANSWER_ROLES = r"^assistant\Z"


class TurnRecords(RecordKind):
    """Records of a prompt and answers, each text or chat turns: the checks they share (feedback records too,
    records/feedback.py)."""

    # the fields holding text or chat turns: the prompt, then the answers
    turn_fields: ClassVar[tuple[str, ...]]

    def frame(self, chunk: list[dict[str, Any]], labels: list[str]) -> dict[str, list[Any]]:
        """Columns the expectations read, whatever a row holds."""
        columns: dict[str, list[Any]] = {}
        for field in self.turn_fields:
            values = [row.get(field) for row in chunk]
            texts = [contents(value) for value in values]
            columns[f"_{field}_type"] = [None if value is None else json_kind(value) for value in values]
            # a missing field or a value of the wrong type is reported once, by its own check
            columns[f"_{field}_turns_ok"] = [not isinstance(value, list) or turns_ok(value) for value in values]
            columns[f"_{field}_roles"] = [roles(value, field) for value in values]
            columns[f"_{field}_empty"] = [None if t is None else sum(blank(c) for c in t) for t in texts]
            columns[f"_{field}_text"] = [None if t is None else "\n".join(t) for t in texts]
        return columns

    def expectations(self, expect: Expect, gxe: Any, settings: ValidateConfig, labels: list[str]) -> None:
        """Each field's checks, most basic first."""
        min_chars, max_chars = settings.min_chars, settings.max_chars
        code = RejectCode
        for field in self.turn_fields:
            text = f"_{field}_text"
            expect(gxe.ExpectColumnValuesToNotBeNull(column=f"_{field}_type"), code.MISSING_FIELD, field)
            expect(gxe.ExpectColumnValuesToBeInSet(column=f"_{field}_type", value_set=["string", "array"]),
                   code.WRONG_TYPE, field)
            expect(gxe.ExpectColumnValuesToBeInSet(column=f"_{field}_turns_ok", value_set=[True]), code.CHAT_TURNS,
                   field)
            expect(gxe.ExpectColumnValuesToMatchRegex(column=f"_{field}_roles",
                                                      regex=PROMPT_ROLES if field == "prompt" else ANSWER_ROLES),
                   code.CHAT_ORDER, field)
            expect(gxe.ExpectColumnValuesToBeBetween(column=f"_{field}_empty", max_value=0), code.EMPTY, field)
            if min_chars > 1:
                expect(gxe.ExpectColumnValueLengthsToBeBetween(column=text, min_value=min_chars), code.TOO_SHORT,
                       field)
            expect(gxe.ExpectColumnValuesToNotMatchRegex(column=text, regex="\x00"), code.NUL_BYTE, field)
            expect(gxe.ExpectColumnValuesToNotMatchRegex(column=text, regex=CONTROL), code.CONTROL_CHAR, field)
            expect(gxe.ExpectColumnValueLengthsToBeBetween(column=text, max_value=max_chars), code.TOO_LONG, field)

    def describe(self, code: RejectCode, field: str, row: dict[str, Any], settings: ValidateConfig,
                 labels: list[str]) -> str:
        """A person's reading of one failure of a prompt's or an answer's field."""
        min_chars, max_chars = settings.min_chars, settings.max_chars
        value = row.get(field)
        texts = contents(value) or []
        size = sum(map(len, texts))
        expected = ("an optional system turn, then user and assistant alternating, ending with user"
                    if field == "prompt" else "one assistant turn")
        details = {
            RejectCode.MISSING_FIELD: "missing",
            RejectCode.WRONG_TYPE: f"a {json_kind(value)} where text or a list of chat turns is expected",
            RejectCode.CHAT_TURNS: "not a list of turns with a string role and string content",
            RejectCode.CHAT_ORDER: f"roles {roles(value, field)!r} are out of order; expected {expected}",
            RejectCode.EMPTY: "empty or only whitespace" if isinstance(value, str) else
            f"turn {next((i for i, c in enumerate(texts, 1) if blank(c)), 0)} is empty",
            RejectCode.TOO_SHORT: f"{size} characters, under validate.min_chars ({min_chars})",
            RejectCode.TOO_LONG: f"{size} characters, over validate.max_chars ({max_chars})",
            RejectCode.NUL_BYTE: "holds a NUL character",
            RejectCode.CONTROL_CHAR: "holds a control character (not tab, newline or carriage return)",
            RejectCode.SAME_ANSWERS: "the same answer as chosen (whitespace aside): the pair prefers nothing",
        }
        return f"{field}: {details.get(code, str(code))}"


class PreferenceRecords(TurnRecords):
    """A prompt, a chosen and a rejected answer; prompts and answers are text or chat turns."""

    name = "preference"
    fields = FIELDS
    asked_fields = ("prompt",)
    turn_fields = FIELDS
    # the column names public preference datasets use, for each canonical field, in the order they are tried
    columns = {"prompt": ("prompt", "question", "instruction"),
               "chosen": ("chosen", "response_chosen", "preferred"),
               "rejected": ("rejected", "response_rejected", "dispreferred")}

    def canonical(self, row: dict[str, Any], mapped: dict[str, str]) -> dict[str, Any]:
        """The fields; where each answer holds the whole conversation (UltraFeedback's chat turns, HH-RLHF's
        "Human: ... Assistant: ..." transcripts), the turns both share, up to their last user turn, are the prompt
        and the turn after them each answer. A prompt column that says otherwise is left for validation to judge."""
        record = super().canonical(row, mapped)
        split = shared_prompt(as_turns(record["chosen"]), as_turns(record["rejected"]))
        if split is not None and (record["prompt"] is None or same_prompt(record["prompt"], split[0])):
            record.update(zip(FIELDS, split, strict=True))
        return record

    def frame(self, chunk: list[dict[str, Any]], labels: list[str]) -> dict[str, list[Any]]:
        columns = super().frame(chunk, labels)
        columns["_same_answers"] = [folded(row.get("chosen")) is not None and
                                    folded(row.get("chosen")) == folded(row.get("rejected")) for row in chunk]
        return columns

    def expectations(self, expect: Expect, gxe: Any, settings: ValidateConfig, labels: list[str]) -> None:
        """Each field's checks, then the pair's: two answers that are the same teach nothing."""
        super().expectations(expect, gxe, settings, labels)
        expect(gxe.ExpectColumnValuesToBeInSet(column="_same_answers", value_set=[False]), RejectCode.SAME_ANSWERS,
               "rejected")

    def content(self, row: dict[str, Any]) -> list[str]:
        """What makes two pairs the same: the prompt's turns and both answers."""
        turns = [f"{turn['role']}:{turn['content']}" for turn in prompt_messages(row["prompt"])]
        return [*turns, answer_text(row["chosen"]), answer_text(row["rejected"])]

    def sample(self, row: dict[str, Any]) -> dict[str, Any]:
        return {"prompt": prompt_messages(row["prompt"])[-1]["content"], "chosen": answer_text(row["chosen"]),
                "rejected": answer_text(row["rejected"])}


PREFERENCE = PreferenceRecords()


# a turn of an HH-RLHF transcript: "\n\nHuman: ..." or "\n\nAssistant: ..."
TRANSCRIPT_TURN = re.compile(r"\n\n(Human|Assistant):[ \t]?")
TRANSCRIPT_ROLES = {"Human": "user", "Assistant": "assistant"}


def as_turns(value: Any) -> Messages | None:
    """A field's chat turns: its list of turns, or the turns of a transcript; None for anything else."""
    if turns_ok(value):
        return [{"role": turn["role"], "content": turn["content"]} for turn in value]
    if not isinstance(value, str) or not value.startswith("\n\nHuman:"):
        return None
    parts = TRANSCRIPT_TURN.split(value)[1:]
    return [{"role": TRANSCRIPT_ROLES[role], "content": text.strip()} for role, text in zip(parts[::2], parts[1::2],
                                                                                        strict=True)]


def shared_prompt(chosen: Messages | None, rejected: Messages | None) -> tuple[Messages, Messages, Messages] | None:
    """The turns two conversations share, up to the last user turn among them, and what follows in each; None
    where they share no user turn."""
    if not chosen or not rejected:
        return None
    shared = next((index for index, (a, b) in enumerate(zip(chosen, rejected, strict=False)) if a != b),
                  min(len(chosen), len(rejected)))
    users = [index for index in range(shared) if chosen[index]["role"] == "user"]
    if not users:
        return None
    cut = users[-1] + 1
    return chosen[:cut], chosen[cut:], rejected[cut:]


def same_prompt(prompt: Any, turns: Messages) -> bool:
    """Whether a prompt column says what the shared turns say: the same turns, or the last user turn's text."""
    if isinstance(prompt, str):
        return " ".join(prompt.split()) == " ".join(turns[-1]["content"].split())
    return as_turns(prompt) == turns


def turns_ok(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, dict) and isinstance(t.get("role"), str) and isinstance(t.get("content"), str) for t in value)


def contents(value: Any) -> list[str] | None:
    """The texts of a field: a string alone, or each turn's content; None when it is neither."""
    if isinstance(value, str):
        return [value]
    return [turn["content"] for turn in value] if turns_ok(value) else None


def roles(value: Any, field: str) -> str | None:
    """The roles of a field as one string: a string prompt is a user turn, a string answer an assistant turn."""
    if isinstance(value, str):
        return "user" if field == "prompt" else "assistant"
    return role_sequence(value) if turns_ok(value) else None


def folded(value: Any) -> str | None:
    """An answer's text with whitespace runs folded, for telling two answers apart."""
    texts = contents(value)
    return " ".join(" ".join(texts).split()) if texts is not None else None
