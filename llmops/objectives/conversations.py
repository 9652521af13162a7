"""Conversations: instruction records (Alpaca) and chat records (role/content turns, ShareGPT mapped).

Both become a list of turns that the chat template renders; the last assistant turn is what a
model is asked to produce when it is scored, and every assistant turn is what it learns.
"""

from __future__ import annotations

import re
from typing import Any

from llmops.config.schema import ValidateConfig
from llmops.io.rejects import CONTROL, RejectCode, blank, json_kind
from llmops.objectives.records import Expect, RecordKind, control_name

# chat turns, as the chat templates render them (not imported from there: a template edit would change the data
# stages' keys, which read conversations but never render one)
Messages = list[dict[str, str]]
# ShareGPT-style turns: {"from": "human", "value": "..."}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "bot": "assistant",
                  "model": "assistant", "system": "system"}
# an optional system turn, then user and assistant alternating, ending with assistant
CHAT_ROLES = r"^(system,)?(user,assistant,)*user,assistant\Z"
ROLES = ("system", "user", "assistant")


def role_sequence(turns: Messages) -> str:
    """The turns' roles as the order checks read them, joined by commas; a role that is none of ROLES reads as "?"
    (taken as it is, `user,assistant` in one role would pass for two turns)."""
    return ",".join(turn["role"] if turn["role"] in ROLES else "?" for turn in turns)


def prompt_messages(row: dict[str, Any]) -> Messages:
    """An instruction record's prompt as a user turn: the instruction, then the input if there is one."""
    prompt = row["instruction"] if not row.get("input") else f"{row['instruction']}\n\n{row['input']}"
    return [{"role": "user", "content": prompt}]


def prompt_and_reference(messages: Messages) -> tuple[Messages, str]:
    """The turns before the last assistant turn, and that turn's content: what generation is scored on."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages[:last], messages[last]["content"]


def sharegpt_turn(turn: Any) -> Any:
    """{"from": "human", "value": ...} becomes {"role": "user", "content": ...}; other turns stay as they are."""
    if isinstance(turn, dict) and "from" in turn and "value" in turn and "role" not in turn:
        return {"role": SHAREGPT_ROLES.get(str(turn["from"]).lower(), turn["from"]), "content": turn["value"]}
    return turn


class Conversational(RecordKind):
    """A record that is a conversation: what the model is asked, and the answer it learns."""

    def conversation(self, row: dict[str, Any]) -> Messages:
        raise NotImplementedError

    def sample(self, row: dict[str, Any]) -> dict[str, Any]:
        prompt, reference = prompt_and_reference(self.conversation(row))
        return {"prompt": prompt[-1]["content"], "reference": reference}


class InstructionRecords(Conversational):
    """Alpaca: an instruction, an optional input, the output."""

    name = "instruction"
    fields = ("instruction", "input", "output")
    asked_fields = ("instruction", "input")
    text_fields = (("instruction", True), ("input", False), ("output", True))

    def conversation(self, row: dict[str, Any]) -> Messages:
        return prompt_messages(row) + [{"role": "assistant", "content": row["output"]}]


class ChatRecords(Conversational):
    """Turns of {role, content}; ShareGPT's {from, value} turns are mapped."""

    name = "chat"
    fields = ("messages",)
    asked_fields = ("messages",)
    columns = {"messages": ("messages", "conversations")}

    def canonical(self, row: dict[str, Any], mapped: dict[str, str]) -> dict[str, Any]:
        record = super().canonical(row, mapped)
        if isinstance(record["messages"], list):
            record["messages"] = [sharegpt_turn(turn) for turn in record["messages"]]
        return record

    def conversation(self, row: dict[str, Any]) -> Messages:
        return [{"role": turn["role"], "content": turn["content"]} for turn in row["messages"]]

    def expectations(self, expect: Expect, gxe: Any, settings: ValidateConfig, labels: list[str]) -> None:
        code = RejectCode
        expect(gxe.ExpectColumnValuesToNotBeNull(column="_messages_type"), code.MISSING_FIELD, "messages")
        expect(gxe.ExpectColumnValuesToBeInSet(column="_turns_ok", value_set=[True]), code.CHAT_TURNS, "messages")
        expect(gxe.ExpectColumnValuesToMatchRegex(column="_roles", regex=CHAT_ROLES), code.CHAT_ORDER, "messages")
        expect(gxe.ExpectColumnValuesToBeBetween(column="_empty_turns", max_value=0), code.EMPTY, "messages")
        expect(gxe.ExpectColumnValuesToBeInSet(column="_nul", value_set=[False]), code.NUL_BYTE, "messages")
        expect(gxe.ExpectColumnValuesToBeInSet(column="_control", value_set=[False]), code.CONTROL_CHAR, "messages")
        expect(gxe.ExpectColumnValuesToBeBetween(column="_chars", max_value=settings.max_chars), code.TOO_LONG,
               "messages")

    def frame(self, chunk: list[dict[str, Any]], labels: list[str]) -> dict[str, list[Any]]:
        values = [row.get("messages") for row in chunk]
        summaries = [chat_summary(value) for value in values]
        columns = {"_messages_type": [None if value is None else json_kind(value) for value in values]}
        for name in ("_turns_ok", "_roles", "_empty_turns", "_nul", "_control", "_chars"):
            columns[name] = [summary[name] for summary in summaries]
        return columns

    def describe(self, code: RejectCode, field: str, row: dict[str, Any], settings: ValidateConfig,
                 labels: list[str]) -> str:
        messages = row.get("messages")
        if code == RejectCode.MISSING_FIELD:
            return "messages: missing"
        if code == RejectCode.CHAT_TURNS:
            return f"messages: {turns_problem(messages)}"
        return describe_chat(code, messages, settings)

    def content(self, row: dict[str, Any]) -> list[str]:
        return [f"{turn['role']}:{turn['content']}" for turn in row["messages"]]


def chat_summary(messages: Any) -> dict[str, Any]:
    turns_ok = isinstance(messages, list) and bool(messages) and all(
        isinstance(t, dict) and isinstance(t.get("role"), str) and isinstance(t.get("content"), str) for t in messages)
    if not turns_ok:
        return {"_turns_ok": messages is None, "_roles": None, "_empty_turns": None, "_nul": None,
                "_control": None, "_chars": None}
    contents = [turn["content"] for turn in messages]
    return {"_turns_ok": True, "_roles": role_sequence(messages),
            "_empty_turns": sum(blank(c) for c in contents), "_nul": any("\x00" in c for c in contents),
            "_control": any(re.search(CONTROL, c) for c in contents), "_chars": sum(len(c) for c in contents)}


def describe_chat(code: RejectCode, messages: list[dict[str, Any]], settings: ValidateConfig) -> str:
    contents = [turn["content"] for turn in messages]
    if code == RejectCode.CHAT_ORDER:
        roles = ", ".join(turn["role"] for turn in messages)
        return (f"messages: roles {roles!r} are out of order; expected an optional system turn, then user and "
                "assistant alternating, ending with assistant")
    if code == RejectCode.EMPTY:
        return f"messages: turn {next(i for i, c in enumerate(contents, 1) if blank(c))} is empty"
    if code == RejectCode.TOO_LONG:
        return f"messages: {sum(map(len, contents))} characters, over validate.max_chars ({settings.max_chars})"
    nul = code == RejectCode.NUL_BYTE
    turn = next(i for i, c in enumerate(contents, 1) if re.search(chr(0) if nul else CONTROL, c))
    what = "a NUL character" if nul else f"a control character ({control_name(contents[turn - 1])})"
    return f"messages: turn {turn} holds {what}"


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


INSTRUCTION = InstructionRecords()
CHAT = ChatRecords()
