"""Tool calls in chat records: the two layouts read into one shape, their checks, and calls read back from text.

Two layouts are read:
- OpenAI's messages: `tools` on the row (`{"type": "function", "function": {name, description,
  parameters}}`), assistant turns with `tool_calls` (`{"id", "type": "function", "function":
  {"name", "arguments"}}`, the arguments a JSON string or an object), `tool` turns answering a call
  by `tool_call_id`;
- ShareGPT as LLaMA-Factory writes it: `function_call` turns whose value is the call as JSON
  (`{"name", "arguments"}`, or a list of them), `observation` turns holding a tool's result, and a
  `tools` field (a JSON string or a list of `{name, description, parameters}`).

A valid row keeps its calls and tools as JSON text (a table column of objects would fill every
row's arguments with the keys of every other row's): a call turn is `{"role": "assistant",
"content", "tool_calls": "[{name, arguments}, ...]"}`, a result `{"role": "tool", "content"}`.
A call is written in the text a model generates as `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
(the Hermes and Qwen convention, which the built-in template follows; objectives/tool_answers.py reads
it back).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# the reject codes of tool data, with what each means
TOOL_CODES = {
    "tools_invalid": "the tools field is not a list of function definitions, each with a name",
    "tool_arguments": "a call's arguments are not a JSON object",
    "tool_unknown": "a call names a tool the row does not declare in tools",
    "tool_result_orphan": "a tool result answers no call of the assistant turn before it",
}
# ShareGPT roles of tool data (LLaMA-Factory): a call by the assistant, and a tool's result
SHAREGPT_CALL, SHAREGPT_RESULT = "function_call", "observation"

Call = tuple[str, Any]  # a tool's name and its arguments (a JSON object, parsed)


class ToolProblem(ValueError):
    """What is wrong with a row's tool data: a reject code and a message naming the turn."""

    def __init__(self, code: str, message: str, field: str = "messages") -> None:
        super().__init__(message)
        self.code, self.field = code, field


def sharegpt_tool_turn(turn: dict[str, Any]) -> dict[str, Any] | None:
    """A LLaMA-Factory `function_call` or `observation` turn in OpenAI's shape (the call left as its text, which
    validation reads); None for any other turn."""
    source = str(turn.get("from", "")).lower()
    if source == SHAREGPT_CALL:
        return {"role": "assistant", "content": "", "tool_calls": turn.get("value")}
    if source in (SHAREGPT_RESULT, "tool"):
        return {"role": "tool", "content": turn.get("value")}
    return None


def has_tool_data(messages: Any, tools: Any) -> bool:
    """Whether a row holds tools, a call or a tool result (a plain chat row is stored as it came)."""
    return tools is not None or (isinstance(messages, list) and any(
        isinstance(turn, dict) and (turn.get("tool_calls") is not None or turn.get("role") == "tool")
        for turn in messages))


def is_call(turn: dict[str, Any]) -> bool:
    return turn.get("role") == "assistant" and turn.get("tool_calls") not in (None, [], "")


def turn_role(turn: dict[str, Any]) -> str:
    """A turn's role as the order check reads it: an assistant turn that calls tools is a `call`."""
    return "call" if is_call(turn) else turn["role"]


def parsed_json(value: Any) -> Any:
    """A JSON text parsed (a value that is not text as it is); ValueError if it is not JSON."""
    return json.loads(value) if isinstance(value, str) else value


def declared_tools(tools: Any) -> list[dict[str, Any]]:
    """The row's tools in OpenAI's shape (what `apply_chat_template(tools=...)` reads), or ToolProblem."""
    try:
        listed = parsed_json(tools)
    except ValueError:
        raise ToolProblem("tools_invalid", "tools: not valid JSON", "tools") from None
    if not isinstance(listed, list) or not listed:
        raise ToolProblem("tools_invalid", "tools: expected a non-empty list of function definitions", "tools")
    declared = []
    for number, tool in enumerate(listed, 1):
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ToolProblem("tools_invalid", f"tools: definition {number} has no function name", "tools")
        definition = {"name": function["name"], "description": function.get("description", ""),
                      "parameters": function.get("parameters", {"type": "object", "properties": {}})}
        declared.append({"type": "function", "function": definition})
    return declared


def turn_calls(turn: dict[str, Any], number: int) -> list[tuple[Call, str | None]]:
    """An assistant turn's calls, each with its id (None where the layout gives none), or ToolProblem."""
    try:
        listed = parsed_json(turn["tool_calls"])
    except ValueError:
        raise ToolProblem("tool_arguments", f"messages: turn {number}: the tool call is not valid JSON") from None
    listed = listed if isinstance(listed, list) else [listed]
    calls = []
    for call in listed:
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ToolProblem("chat_turns", f"messages: turn {number}: a tool call without a function name")
        calls.append(((function["name"], call_arguments(function.get("arguments"), number, function["name"])),
                      call.get("id") if isinstance(call.get("id"), str) else None))
    return calls


def call_arguments(arguments: Any, number: int, name: str) -> Any:
    """A call's arguments as a JSON object, or ToolProblem saying why they are not one."""
    if arguments is None:
        return {}
    try:
        value = parsed_json(arguments)
    except ValueError:
        raise ToolProblem("tool_arguments", f"messages: turn {number}: the arguments of {name} are not valid "
                          "JSON") from None
    if not isinstance(value, dict):
        raise ToolProblem("tool_arguments", f"messages: turn {number}: the arguments of {name} are a "
                          f"{type(value).__name__}, not a JSON object")
    return value


@dataclass
class Pending:
    """The calls of the last call turn that results may still answer."""

    ids: list[str | None]
    answered: int = 0

    def answer(self, call_id: Any) -> bool:
        """Whether one more result answers a call (by its id where the call has one)."""
        if isinstance(call_id, str) and any(ids is not None for ids in self.ids):
            if call_id not in self.ids:
                return False
            self.ids[self.ids.index(call_id)] = ""  # answered once only
        elif self.answered >= len(self.ids):
            return False
        self.answered += 1
        return True


def check_tool_row(messages: list[dict[str, Any]], tools: Any) -> None:
    """ToolProblem for the first thing wrong with a row's tool data: its tools, a call's arguments or name, a result
    that answers no call. The turns' order is checked with every chat row's."""
    names = {tool["function"]["name"] for tool in declared_tools(tools)} if tools is not None else set()
    pending: Pending | None = None
    for number, turn in enumerate(messages, 1):
        if is_call(turn):
            calls = turn_calls(turn, number)
            unknown = [name for (name, _), _ in calls if name not in names]
            if unknown:
                declared = ", ".join(sorted(names)) or "none: the row has no tools field"
                raise ToolProblem("tool_unknown", f"messages: turn {number} calls {unknown[0]!r}, which is not "
                                  f"declared in tools (declared: {declared})")
            pending = Pending([call_id for _, call_id in calls])
        elif turn.get("role") == "tool":
            if pending is None or not pending.answer(turn.get("tool_call_id")):
                raise ToolProblem("tool_result_orphan", f"messages: turn {number} is a tool result that answers no "
                                  "call of the assistant turn before it")
        else:
            pending = None


def tool_problem(messages: Any, tools: Any) -> ToolProblem | None:
    """The first problem of a row's tool data, or None (rows whose turns are not well formed are judged by the
    chat checks first)."""
    try:
        check_tool_row(messages, tools)
    except ToolProblem as problem:
        return problem
    return None


def stored_row(row: dict[str, Any]) -> dict[str, Any]:
    """A valid row with tool data as the later stages read it: calls and tools as JSON text."""
    messages = []
    for number, turn in enumerate(row["messages"], 1):
        if is_call(turn):
            calls = [{"name": name, "arguments": arguments} for (name, arguments), _ in turn_calls(turn, number)]
            messages.append({"role": "assistant", "content": turn.get("content") or "",
                             "tool_calls": json.dumps(calls, ensure_ascii=False)})
        else:
            messages.append({"role": turn["role"], "content": turn["content"]})
    stored = {**row, "messages": messages}
    if row.get("tools") is not None:
        stored["tools"] = json.dumps(declared_tools(row["tools"]), ensure_ascii=False)
    return stored


def rendered_turn(turn: dict[str, Any]) -> dict[str, Any]:
    """A stored turn as chat templates read it: calls in OpenAI's shape, their arguments objects."""
    if not turn.get("tool_calls"):
        return {"role": turn["role"], "content": turn["content"]}
    calls = [{"type": "function", "function": call} for call in json.loads(turn["tool_calls"])]
    return {"role": "assistant", "content": turn.get("content") or "", "tool_calls": calls}


def stored_tools(row: dict[str, Any]) -> list[dict[str, Any]] | None:
    return json.loads(row["tools"]) if row.get("tools") else None


def turn_text(turn: dict[str, Any]) -> str:
    """What an assistant turn says as generated text: its content, then each call in the template's convention."""
    calls = [call["function"] for call in turn.get("tool_calls") or []]
    return (turn.get("content") or "") + "".join(call_text(call["name"], call["arguments"]) for call in calls)


def call_text(name: str, arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}</tool_call>"
