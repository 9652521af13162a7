"""The service's reading of OpenAI chat bodies: what it answers, and each bad body's status and one line."""

from __future__ import annotations

import json

import pytest

from llmops.config.schema import TrackingConfig
from llmops.io.errors import UserError
from llmops.serving import openai_api
from llmops.serving.openai_api import BadRequest
from llmops.serving.service import Replica, ServeSettings, check_access

TURNS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello"}, {"role": "user", "content": [{"type": "text", "text": "Sum?"}]}]


def test_a_chat_body_becomes_the_row_predict_reads() -> None:
    request = openai_api.chat_request(openai_api.read_body(json.dumps(
        {"model": "m", "messages": TURNS, "stream": True, "max_tokens": 7, "temperature": 0, "user": "u"}).encode()))
    assert request.row == {"messages": [*TURNS[:3], {"role": "user", "content": "Sum?"}]}
    assert request.stream and request.max_tokens == 7


@pytest.mark.parametrize(("body", "status", "says"), [
    (b"{broken", 400, "the body is not JSON"),
    (b"[1, 2]", 400, "must be a JSON object, not list"),
    (b'{"messages": []}', 400, "messages: expected a non-empty list"),
    (b'{"messages": [{"role": "user", "content": 5}]}', 400, "messages[0].content: expected a string, not int"),
    (b'{"messages": [{"role": "robot", "content": "x"}]}', 400, "messages[0].role: expected one of"),
    (b'{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}', 400,
     "the last turn must be the user's"),
    (b'{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}', 400, "out of order"),
    (b'{"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}, '
     b'{"role": "user", "content": "c"}]}', 400, "out of order"),
    (b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400, "only text parts"),
    (b'{"messages": [{"role": "user", "content": "a"}], "temperature": 0.7}', 400, "decodes greedily"),
    (b'{"messages": [{"role": "user", "content": "a"}], "n": 2}', 400, "n: only one choice"),
    (b'{"messages": [{"role": "user", "content": "a"}], "tool_choice": "auto"}', 400,
     "unsupported field 'tool_choice'"),
    (b'{"messages": [{"role": "user", "content": "a"}], "tools": "calculator"}', 400,
     "tools: expected a list of function definitions"),
    (b'{"messages": [{"role": "user", "content": "a"}], "max_tokens": 0}', 400, "max_tokens: expected a whole"),
    (b'{"messages": [{"role": "user", "content": "a"}], "stream": "yes"}', 400, "stream: expected true or false"),
    (b'{"messages": "' + b"x" * openai_api.MAX_BODY_BYTES + b'"}', 413, "the limit is 1048576"),
])
def test_each_bad_body_is_one_line_with_its_status(body: bytes, status: int, says: str) -> None:
    with pytest.raises(BadRequest) as raised:
        openai_api.chat_request(openai_api.read_body(body))
    assert raised.value.status == status and says in str(raised.value) and "\n" not in str(raised.value)


def test_a_completion_whole_and_as_events_carries_the_version() -> None:
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    whole = openai_api.chat_completion("tr-1", "m/2", "hi there", usage, "stop")
    assert whole["model"] == "m/2" and whole["choices"][0]["message"] == {"role": "assistant", "content": "hi there"}
    events = list(openai_api.chat_chunks("tr-1", "m/2", "hi there", usage, "length"))
    assert events[-1] == "data: [DONE]\n\n" and all(event.startswith("data: ") for event in events)
    chunks = [json.loads(event[6:]) for event in events[:-1]]
    assert "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks) == "hi there"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"] == usage
    assert {chunk["model"] for chunk in chunks} == {"m/2"}


def test_a_completions_body_becomes_a_prefix_row_and_its_bad_fields_are_one_line() -> None:
    request = openai_api.completion_request(openai_api.read_body(json.dumps(
        {"model": "m", "prompt": ["Once upon"], "max_tokens": 5, "stream": True, "temperature": 0}).encode()))
    assert request.row == {"prefix": "Once upon"} and request.stream and request.max_tokens == 5
    for body, says in (({"prompt": ""}, "prompt: expected one non-empty string"),
                       ({"prompt": ["a", "b"]}, "prompt: expected one non-empty string"),
                       ({"prompt": "a", "echo": True}, "echo: not supported"),
                       ({"prompt": "a", "logprobs": 3}, "logprobs: not supported"),
                       ({"prompt": "a", "messages": []}, "unsupported field 'messages'")):
        with pytest.raises(BadRequest, match=says):
            openai_api.completion_request(body)
    whole = openai_api.text_completion("tr-1", "m/2", " a time", {"prompt_tokens": 3}, "stop")
    assert whole["object"] == "text_completion" and whole["choices"][0]["text"] == " a time"
    events = list(openai_api.completion_chunks("tr-1", "m/2", " a time", {"prompt_tokens": 3}, "length"))
    chunks = [json.loads(event[6:]) for event in events[:-1]]
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == " a time"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and events[-1] == "data: [DONE]\n\n"


def test_beyond_loopback_only_with_a_key_checked_on_every_request() -> None:
    check_access("127.0.0.1", None)
    with pytest.raises(UserError, match="--host 0.0.0.0 listens beyond this machine: give an API key"):
        check_access("0.0.0.0", None)
    check_access("0.0.0.0", "k3y")
    replica = Replica.__new__(Replica)  # the key check alone, without a model
    replica.settings = ServeSettings(reference="m", tracking=TrackingConfig(), api_key="k3y")
    assert replica.authorized("Bearer k3y") and not replica.authorized("Bearer nope")
    assert not replica.authorized(None) and not replica.authorized("")


def test_tools_and_tool_turns_are_read_and_a_reply_that_calls_answers_with_tool_calls() -> None:
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    body = {"messages": [{"role": "user", "content": "2+3?"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c1", "type": "function",
                              "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "5"}], "tools": tools}
    request = openai_api.chat_request(body)
    assert request.row["tools"] == tools
    assert request.row["messages"][1] == {"role": "assistant", "content": "", "tool_calls": body["messages"][1][
        "tool_calls"]}
    assert request.row["messages"][2] == {"role": "tool", "content": "5", "tool_call_id": "c1"}
    usage = {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}
    text = '<tool_call>{"name": "calculator", "arguments": {"expression": "7*6"}}</tool_call>'
    whole = openai_api.chat_completion("tr-1", "m/2", text, usage, "stop")
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "7*6"}'}}]}
    # a reply cut at the length limit is not a call, and a plain reply stays text
    assert openai_api.chat_completion("tr-1", "m/2", text, usage, "length")["choices"][0]["message"]["content"] == text
    assert openai_api.chat_completion("tr-1", "m/2", "5", usage, "stop")["choices"][0]["finish_reason"] == "stop"
    events = list(openai_api.chat_chunks("tr-1", "m/2", None, usage, "tool_calls", choice["message"]["tool_calls"]))
    deltas = [json.loads(event[6:])["choices"][0]["delta"] for event in events[:-1]]
    assert deltas[1]["tool_calls"] == [{"index": 0, **choice["message"]["tool_calls"][0]}]
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "tool_calls"
