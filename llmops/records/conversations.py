"""Conversations: instruction records (Alpaca) and chat records (role/content turns, ShareGPT mapped).

Both become a list of turns that the chat template renders; the last assistant turn is what a
model is asked to produce when it is scored, and every assistant turn is what it learns. Chat
records may call tools (records/tool_calls.py): assistant turns with calls, tool turns with
results, and the row's tools, which the template renders too.
"""

from __future__ import annotations

import re
from typing import Any

from llmops.config.schema import ValidateConfig
from llmops.io.rejects import CONTROL, RejectCode, blank, json_kind
from llmops.records import tool_calls
from llmops.records.base import Expect, RecordKind, control_name
from llmops.records.turns import Messages, conversation
from llmops.records.turns import prompt_messages as prompt_turns

# ShareGPT-style turns: {"from": "human", "value": "..."}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "bot": "assistant",
                  "model": "assistant", "system": "system"}
# an optional system turn, then user and assistant alternating, ending with assistant; an assistant turn may call
# tools (`call`), each call turn followed by the tools' results before the assistant answers, and the last one may be
# a call whose results are not given
CHAT_ROLES = r"^(system,)?(user,(call,(tool,)+)*assistant,)*user,(call,(tool,)+)*(assistant|call)\Z"
ROLES = ("system", "user", "assistant", "tool")


def role_sequence(turns: Messages) -> str:
    """The turns' roles as the order checks read them, joined by commas; a role that is none of ROLES reads as "?"
    (taken as it is, `user,assistant` in one role would pass for two turns)."""
    return ",".join(tool_calls.turn_role(turn) if turn["role"] in ROLES else "?" for turn in turns)


def prompt_messages(row: dict[str, Any]) -> Messages:
    """An instruction record's prompt as a user turn."""
    return prompt_turns(instruction_prompt(row))


def instruction_prompt(row: dict[str, Any]) -> str:
    """An instruction record's prompt: the instruction, then the input if there is one."""
    return row["instruction"] if not row.get("input") else f"{row['instruction']}\n\n{row['input']}"


def prompt_and_reference(messages: Messages) -> tuple[Messages, str]:
    """The turns before the last assistant turn, and that turn as generated text (its calls written as the template
    writes them): what generation is scored on."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages[:last], tool_calls.turn_text(messages[last])


def sharegpt_turn(turn: Any) -> Any:
    """{"from": "human", "value": ...} becomes {"role": "user", "content": ...} (a LLaMA-Factory function_call an
    assistant turn with the call, an observation a tool turn); other turns stay as they are."""
    if isinstance(turn, dict) and "from" in turn and "value" in turn and "role" not in turn:
        return tool_calls.sharegpt_tool_turn(turn) or {
            "role": SHAREGPT_ROLES.get(str(turn["from"]).lower(), turn["from"]), "content": turn["value"]}
    return turn


class Conversational(RecordKind):
    """A record that is a conversation: what the model is asked, and the answer it learns."""

    def conversation(self, row: dict[str, Any]) -> Messages:
        raise NotImplementedError

    def tools(self, row: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The tools the conversation may call, as chat templates read them (`tools=`); None: no tools."""
        return None

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
        return conversation(instruction_prompt(row), row["output"])

    def corrected(self, messages: list[dict[str, Any]], correction: str) -> tuple[str, dict[str, Any]]:
        """One user turn (no earlier exchange) is an instruction and its output."""
        turns = [turn for turn in messages if turn.get("role") != "system"]
        if len(turns) == 1 and turns[0].get("role") == "user":
            return self.name, {"instruction": turns[0]["content"], "input": "", "output": correction}
        return super().corrected(messages, correction)


class ChatRecords(Conversational):
    """Turns of {role, content}, with tool calls and results; ShareGPT's {from, value} turns are mapped."""

    name = "chat"
    fields = ("messages", "tools")
    asked_fields = ("messages",)
    columns = {"messages": ("messages", "conversations"), "tools": ("tools",)}
    reject_codes = tool_calls.TOOL_CODES
    tool_columns = ("tools",)

    def canonical(self, row: dict[str, Any], mapped: dict[str, str]) -> dict[str, Any]:
        record = super().canonical(row, mapped)
        if isinstance(record["messages"], list):
            record["messages"] = [sharegpt_turn(turn) for turn in record["messages"]]
        if record["tools"] is None:  # a chat without tools is stored as it always was
            del record["tools"]
        return record

    def conversation(self, row: dict[str, Any]) -> Messages:
        return [tool_calls.rendered_turn(turn) for turn in row["messages"]]

    def tools(self, row: dict[str, Any]) -> list[dict[str, Any]] | None:
        return tool_calls.stored_tools(row)

    def valid_row(self, row: dict[str, Any], labels: list[str]) -> dict[str, Any]:
        return tool_calls.stored_row(row) if tool_calls.has_tool_data(row["messages"], row.get("tools")) else row

    def expectations(self, expect: Expect, gxe: Any, settings: ValidateConfig, labels: list[str]) -> None:
        code = RejectCode
        expect(gxe.ExpectColumnValuesToNotBeNull(column="_messages_type"), code.MISSING_FIELD, "messages")
        expect(gxe.ExpectColumnValuesToBeInSet(column="_turns_ok", value_set=[True]), code.CHAT_TURNS, "messages")
        for tool_code in tool_calls.TOOL_CODES:  # each column is None, or the row's first problem's code
            expect(gxe.ExpectColumnValuesToNotBeInSet(column="_tool_problem", value_set=[tool_code]), tool_code,
                   "tools" if tool_code == "tools_invalid" else "messages")
        expect(gxe.ExpectColumnValuesToMatchRegex(column="_roles", regex=CHAT_ROLES), code.CHAT_ORDER, "messages")
        expect(gxe.ExpectColumnValuesToBeBetween(column="_empty_turns", max_value=0), code.EMPTY, "messages")
        expect(gxe.ExpectColumnValuesToBeInSet(column="_nul", value_set=[False]), code.NUL_BYTE, "messages")
        expect(gxe.ExpectColumnValuesToBeInSet(column="_control", value_set=[False]), code.CONTROL_CHAR, "messages")
        expect(gxe.ExpectColumnValuesToBeBetween(column="_chars", max_value=settings.max_chars), code.TOO_LONG,
               "messages")

    def frame(self, chunk: list[dict[str, Any]], labels: list[str]) -> dict[str, list[Any]]:
        values = [row.get("messages") for row in chunk]
        summaries = [chat_summary(row.get("messages"), row.get("tools")) for row in chunk]
        columns = {"_messages_type": [None if value is None else json_kind(value) for value in values]}
        for name in ("_turns_ok", "_tool_problem", "_roles", "_empty_turns", "_nul", "_control", "_chars"):
            columns[name] = [summary[name] for summary in summaries]
        return columns

    def describe(self, code: RejectCode, field: str, row: dict[str, Any], settings: ValidateConfig,
                 labels: list[str]) -> str:
        messages = row.get("messages")
        if code == RejectCode.MISSING_FIELD:
            return "messages: missing"
        if code == RejectCode.CHAT_TURNS:
            problem = tool_calls.tool_problem(messages, row.get("tools")) if turns_well_formed(messages) else None
            return problem.args[0] if problem is not None else f"messages: {turns_problem(messages)}"
        if code in tool_calls.TOOL_CODES:
            problem = tool_calls.tool_problem(messages, row.get("tools"))
            return problem.args[0] if problem is not None else str(code)
        return describe_chat(code, messages, settings)

    def content(self, row: dict[str, Any]) -> list[str]:
        turns = [f"{turn['role']}:{turn['content']}" + (f"|calls:{turn['tool_calls']}" if turn.get("tool_calls")
                                                        else "") for turn in row["messages"]]
        return turns + ([f"tools:{row['tools']}"] if row.get("tools") else [])


def turns_well_formed(messages: Any) -> bool:
    """A non-empty list of turns, each with a string role and string content (a call turn's content may be null)."""
    return isinstance(messages, list) and bool(messages) and all(
        isinstance(t, dict) and isinstance(t.get("role"), str) and (
            isinstance(t.get("content"), str) or (t.get("content") is None and tool_calls.is_call(t)))
        for t in messages)


def chat_summary(messages: Any, tools: Any = None) -> dict[str, Any]:
    if not turns_well_formed(messages):
        return {"_turns_ok": messages is None, "_tool_problem": None, "_roles": None, "_empty_turns": None,
                "_nul": None, "_control": None, "_chars": None}
    problem = tool_calls.tool_problem(messages, tools) if tool_calls.has_tool_data(messages, tools) else None
    if problem is not None and problem.code == RejectCode.CHAT_TURNS:  # a call without a name: not a turn
        return {**chat_summary(None), "_turns_ok": False}
    contents = [turn["content"] or "" for turn in messages]
    return {"_turns_ok": True, "_tool_problem": problem.code if problem else None, "_roles": role_sequence(messages),
            "_empty_turns": sum(blank(c) and not tool_calls.is_call(t)
                                for c, t in zip(contents, messages, strict=True)),
            "_nul": any("\x00" in c for c in contents),
            "_control": any(re.search(CONTROL, c) for c in contents), "_chars": sum(len(c) for c in contents)}


def describe_chat(code: RejectCode, messages: list[dict[str, Any]], settings: ValidateConfig) -> str:
    contents = [turn["content"] or "" for turn in messages]
    if code == RejectCode.CHAT_ORDER:
        roles = ", ".join(tool_calls.turn_role(turn) if turn["role"] in ROLES else turn["role"] for turn in messages)
        return (f"messages: roles {roles!r} are out of order; expected an optional system turn, then user and "
                "assistant alternating, ending with assistant (an assistant turn that calls tools, `call`, is "
                "followed by the tools' results before the answer, or ends the conversation)")
    if code == RejectCode.EMPTY:
        empty = next(i for i, (c, t) in enumerate(zip(contents, messages, strict=True), 1)
                     if blank(c) and not tool_calls.is_call(t))
        return f"messages: turn {empty} is empty"
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
