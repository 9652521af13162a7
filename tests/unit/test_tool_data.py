"""Tool-calling chat data: both layouts read into one shape, and each kind of bad tool data quarantined."""

import json
from pathlib import Path

import pytest

from llmops.config.schema import DataConfig, PipelineConfig
from llmops.io.files import read_jsonl
from llmops.io.tables import table_rows
from tests.helpers import project_at, stage

CALC = {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                         "parameters": {"type": "object",
                                                        "properties": {"expression": {"type": "string"}}}}}
UNITS = {"name": "convert_units", "description": "Convert a quantity.",
         "parameters": {"type": "object", "properties": {"value": {"type": "number"}, "from": {"type": "string"},
                                                         "to": {"type": "string"}}}}


@pytest.fixture(autouse=True)
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return project_at(tmp_path, monkeypatch)


def openai_row(arguments: object = '{"expression": "2+3"}', name: str = "calculator", result_id: str = "c1",
               tools: object = (CALC,)) -> dict:
    return {"tools": list(tools) if isinstance(tools, tuple) else tools, "messages": [
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": result_id, "content": "5"},
        {"role": "assistant", "content": "2+3 is 5."}]}


def sharegpt_row(call: str, tools: str) -> dict:
    """LLaMA-Factory's layout: the call and the tools as JSON text."""
    return {"conversations": [{"from": "human", "value": "Convert 3 km to miles."},
                              {"from": "function_call", "value": call},
                              {"from": "observation", "value": "1.864"},
                              {"from": "gpt", "value": "3 km is 1.864 miles."}], "tools": tools}


def validated(tmp_path: Path, rows: list[dict]):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = PipelineConfig(data=DataConfig(kind="chat", path=str(path)))
    result = stage("validate", config, stage("ingest", config))
    quarantine = {q["line"]: q for q in read_jsonl(result.dir / "quarantine.jsonl")}
    return quarantine, list(table_rows(result.dir / "valid"))


def test_both_layouts_are_read_into_one_shape(tmp_path: Path) -> None:
    from llmops.records.conversations import CHAT

    call = json.dumps({"name": "convert_units", "arguments": {"value": 3, "from": "km", "to": "mi"}})
    rows = [openai_row(), openai_row(arguments={"expression": "2+3"}), sharegpt_row(call, json.dumps([UNITS])),
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}]
    quarantine, valid = validated(tmp_path, rows)
    assert quarantine == {}
    # the arguments as JSON text and as an object are the same row
    assert CHAT.conversation(valid[0]) == CHAT.conversation(valid[1])
    assert CHAT.conversation(valid[0])[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+3"}}}]}
    assert CHAT.conversation(valid[0])[2] == {"role": "tool", "content": "5"}
    assert CHAT.tools(valid[0]) == [CALC]
    shared = CHAT.conversation(valid[2])
    assert [turn["role"] for turn in shared] == ["user", "assistant", "tool", "assistant"]
    assert shared[1]["tool_calls"][0]["function"] == {"name": "convert_units",
                                                      "arguments": {"value": 3, "from": "km", "to": "mi"}}
    assert CHAT.tools(valid[2]) == [{"type": "function", "function": UNITS}]
    # a plain chat row in the same table keeps its shape and has no tools
    assert CHAT.conversation(valid[3]) == rows[3]["messages"] and CHAT.tools(valid[3]) is None


def test_each_kind_of_bad_tool_data_is_quarantined_with_its_code_and_field(tmp_path: Path) -> None:
    ending_with_call = openai_row()
    ending_with_call["messages"] = ending_with_call["messages"][:2]
    rows = [
        openai_row(),                                                   # 1 good
        openai_row(arguments='{"expression": "2+3"'),                   # 2 arguments not JSON
        openai_row(arguments="[1, 2]"),                                 # 3 arguments not an object
        openai_row(name="weather"),                                     # 4 a tool not declared
        openai_row(result_id="c9"),                                     # 5 a result answering no call
        openai_row(tools=None),                                         # 6 calls without tools
        openai_row(tools="not json"),                                   # 7 tools not JSON
        openai_row(tools=[{"description": "no name"}]),                 # 8 a tool without a name
        {"tools": [CALC], "messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "5"},
                                       {"role": "assistant", "content": "b"}]},  # 9 a result before any call
        {"tools": [CALC], "messages": [{"role": "user", "content": "a"},
                                       {"role": "assistant", "content": None, "tool_calls": [
                                           {"function": {"name": "calculator", "arguments": "{}"}}]},
                                       {"role": "assistant", "content": "b"}]},  # 10 a call left unanswered
        ending_with_call,                                               # 11 good: a row may end with a call
        sharegpt_row("{not json", json.dumps([UNITS])),                 # 12 a ShareGPT call that is not JSON
        {"tools": [CALC], "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": None,
                                                                          "tool_calls": [{"arguments": "{}"}]}]},
    ]                                                                   # 13 a call without a name
    quarantine, valid = validated(tmp_path, rows)
    found = {line: (q["code"], q["field"]) for line, q in quarantine.items()}
    assert found == {2: ("tool_arguments", "messages"), 3: ("tool_arguments", "messages"),
                     4: ("tool_unknown", "messages"), 5: ("tool_result_orphan", "messages"),
                     6: ("tool_unknown", "messages"), 7: ("tools_invalid", "tools"), 8: ("tools_invalid", "tools"),
                     9: ("tool_result_orphan", "messages"), 10: ("chat_order", "messages"),
                     12: ("tool_arguments", "messages"), 13: ("chat_turns", "messages")}
    assert quarantine[2]["message"] == "messages: turn 2: the arguments of calculator are not valid JSON"
    assert quarantine[3]["message"] == "messages: turn 2: the arguments of calculator are a list, not a JSON object"
    assert quarantine[4]["message"] == ("messages: turn 2 calls 'weather', which is not declared in tools "
                                        "(declared: calculator)")
    assert quarantine[5]["message"] == ("messages: turn 3 is a tool result that answers no call of the assistant "
                                        "turn before it")
    assert quarantine[8]["message"] == "tools: definition 1 has no function name"
    assert quarantine[10]["message"].startswith("messages: roles 'user, call, assistant' are out of order")
    assert quarantine[13]["message"] == "messages: turn 2: a tool call without a function name"
    assert [row["_line"] for row in valid] == [1, 11]


def test_calls_read_back_from_generated_text_compare_as_json_values() -> None:
    from llmops.objectives.tool_answers import calls_in, same_json
    from llmops.records.tool_calls import call_text

    text = call_text("calculator", {"expression": "2+3", "round": 2})
    assert calls_in(text) == [("calculator", {"expression": "2+3", "round": 2})]
    assert calls_in('<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>') == [("f", {"a": 1})]
    assert calls_in("no call here") is None
    assert calls_in("<tool_call>{broken</tool_call>") == [("", None)]
    assert same_json({"a": 1, "b": [1.0, "x"]}, {"b": [1, "x"], "a": 1.0})
    assert not same_json({"a": True}, {"a": 1}) and not same_json({"a": "1"}, {"a": 1})
    assert not same_json({"a": 1}, {"a": 1, "b": None})
