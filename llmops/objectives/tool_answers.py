"""Tool calls in generated text: read back, scored against the reference calls, answered in OpenAI's shape.

A model writes a call as `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (the convention
of the built-in template, Hermes' and Qwen's). A held-out row that ends with a call is scored on
whether the generated text calls the right tools (`tool_name_accuracy`), with arguments equal as
JSON values (`tool_arguments_accuracy`), and both (`tool_call_accuracy`, the primary metric of
tool data); rows that end with an answer count in none of the three.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from llmops.objectives.metrics import Metric, ratio
from llmops.records.tool_calls import parsed_json

CALL_OPEN = "<tool_call>"
CALL_TEXT = re.compile(rf"{CALL_OPEN}\s*(.*?)\s*</tool_call>", re.DOTALL)
Call = tuple[str, Any]  # a tool's name and its arguments (a JSON object, parsed)

TOOL_CALL_ACCURACY = Metric("tool_call_accuracy", ratio, True,
                            "share of held-out tool calls made to the right tool with arguments equal as JSON values")
TOOL_NAME_ACCURACY = Metric("tool_name_accuracy", ratio, True, "share of held-out tool calls made to the right tool")
TOOL_ARGUMENTS_ACCURACY = Metric("tool_arguments_accuracy", ratio, True,
                                 "share of held-out tool calls whose arguments equal the reference's as JSON values")
TOOL_METRICS = (TOOL_CALL_ACCURACY, TOOL_NAME_ACCURACY, TOOL_ARGUMENTS_ACCURACY)


def reference_calls(turn: dict[str, Any]) -> list[Call] | None:
    """A rendered assistant turn's calls (records/tool_calls.py `rendered_turn`), None for a turn without."""
    calls = turn.get("tool_calls")
    return [(call["function"]["name"], call["function"]["arguments"]) for call in calls] if calls else None


def call_parts(predictions: list[str], references: list[list[Call] | None]) -> dict[str, np.ndarray]:
    """Per example (hit, 1) where the reference is a call, (0, 0) elsewhere: each metric counts the calls only."""
    columns: dict[str, list[tuple[float, float]]] = {metric.name: [] for metric in TOOL_METRICS}
    for text, expected in zip(predictions, references, strict=True):
        made = calls_in(text) or []
        names = expected is not None and [name for name, _ in made] == [name for name, _ in expected]
        arguments = expected is not None and len(made) == len(expected) and all(
            same_json(got, want) for (_, got), (_, want) in zip(made, expected, strict=True))
        counted = float(expected is not None)
        columns["tool_name_accuracy"].append((float(names), counted))
        columns["tool_arguments_accuracy"].append((float(arguments), counted))
        columns["tool_call_accuracy"].append((float(names and arguments), counted))
    return {name: np.asarray(values, dtype=float).reshape(-1, 2) for name, values in columns.items()}


def openai_calls(text: str) -> list[dict[str, Any]] | None:
    """The calls a generated text makes in OpenAI's shape (`tool_calls` of a chat message: an id, the function's
    name and its arguments as JSON text), None where it makes none."""
    calls = [(name, arguments) for name, arguments in calls_in(text) or [] if name]  # a broken call stays text
    if not calls:
        return None
    return [{"id": f"call_{index}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
            for index, (name, arguments) in enumerate(calls)]


def calls_in(text: str) -> list[Call] | None:
    """The calls a generated text makes (`<tool_call>{json}</tool_call>` each), None where it makes none; a call
    that is not JSON with a name counts, as a call to no tool."""
    found = CALL_TEXT.findall(text)
    if not found:
        return None
    calls: list[Call] = []
    for body in found:
        try:
            call = json.loads(body)
        except ValueError:
            call = None
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            calls.append((call["name"], loose_json(call.get("arguments", {}))))
        else:
            calls.append(("", None))
    return calls


def loose_json(value: Any) -> Any:
    """A generated call's arguments: JSON text parsed, anything else (text that is not JSON too) as it is."""
    try:
        return parsed_json(value)
    except ValueError:
        return value


def same_json(a: Any, b: Any) -> bool:
    """Equal as JSON values: 1 and 1.0 are one number, but true is not 1, and key order does not count."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_json(a[key], b[key]) for key in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    return type(a) is type(b) and a == b
