"""The OpenAI chat-completions and completions APIs, as the service speaks them: a request body read into the row
`llmops predict` reads, and an answer written back as a chat completion or a text completion (whole, or as
server-sent events). A completion's prompt is a `prefix` row: raw text a language model continues, without a chat
template.

A body the service cannot answer is a BadRequest: its HTTP status (400, or 413 for a body over the
size limit) and one line naming the field. The answer of a version's objective (objectives/) is
the same `llmops predict` gives for the same row: the same chat template, lengths and greedy
decoding, so sampling settings other than greedy's are refused rather than silently ignored.
A request may declare `tools` and carry tool calls and results; a reply that calls tools answers
with `tool_calls` on the message and `finish_reason: "tool_calls"`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from llmops.objectives.tool_answers import CALL_TEXT, openai_calls

# a request body larger than this is refused before it is parsed
MAX_BODY_BYTES = 1 << 20
ROLES = ("system", "user", "assistant", "tool")
# fields a client may send that change nothing of a greedy answer (or only say who asks), and the tools it may call
ACCEPTED = {"model", "messages", "tools", "stream", "max_tokens", "max_completion_tokens", "user", "n", "temperature",
            "top_p", "stream_options", "seed", "frequency_penalty", "presence_penalty"}
# the completions API's: a prompt in place of messages
COMPLETION_ACCEPTED = (ACCEPTED - {"messages", "tools", "max_completion_tokens"}) | {"prompt", "echo", "logprobs",
                                                                            "best_of", "suffix"}


class BadRequest(ValueError):
    """A request the service cannot answer: its HTTP status and one line saying why."""

    def __init__(self, message: str, status: int = 400, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after  # seconds, said in a Retry-After header (a 503)


@dataclass(frozen=True)
class ChatRequest:
    """A chat-completions body, read: the row `llmops predict` reads, and how to answer it."""

    row: dict[str, Any]
    stream: bool
    max_tokens: int | None


def read_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body, or BadRequest."""
    if len(raw) > MAX_BODY_BYTES:
        raise BadRequest(f"the body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}", status=413)
    try:
        body = json.loads(raw or b"null")
    except (ValueError, UnicodeDecodeError) as err:
        raise BadRequest(f"the body is not JSON: {str(err).splitlines()[0]}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, not {type(body).__name__}")
    return body


def chat_request(body: dict[str, Any]) -> ChatRequest:
    """A chat-completions body as a predict row, or BadRequest naming the field."""
    unknown = sorted(set(body) - ACCEPTED)
    if unknown:
        raise BadRequest(f"unsupported field {unknown[0]!r} (the fields read: {', '.join(sorted(ACCEPTED))})")
    check_greedy(body)
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("tools: expected a list of function definitions")
    return ChatRequest(row={"messages": messages_of(body.get("messages")), **({"tools": tools} if tools else {})},
                       stream=flag(body, "stream"), max_tokens=max_tokens_of(body))


def completion_request(body: dict[str, Any]) -> ChatRequest:
    """A completions body as a predict row (`{"prefix": prompt}`), or BadRequest naming the field."""
    unknown = sorted(set(body) - COMPLETION_ACCEPTED)
    if unknown:
        accepted = ", ".join(sorted(COMPLETION_ACCEPTED))
        raise BadRequest(f"unsupported field {unknown[0]!r} (the fields read: {accepted})")
    check_greedy(body)
    for name, plain in (("echo", False), ("logprobs", None), ("best_of", 1), ("suffix", None)):
        if body.get(name) not in (None, plain):
            raise BadRequest(f"{name}: not supported; leave it out")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("prompt: expected one non-empty string")
    return ChatRequest(row={"prefix": prompt}, stream=flag(body, "stream"), max_tokens=max_tokens_of(body))


def messages_of(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise BadRequest("messages: expected a non-empty list of {role, content} turns")
    turns = []
    for number, turn in enumerate(value, 1):
        if not isinstance(turn, dict) or turn.get("role") not in ROLES:
            raise BadRequest(f"messages[{number - 1}].role: expected one of {', '.join(ROLES)}")
        content = turn.get("content")
        if isinstance(content, list):  # the parts form: text parts only
            if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                       for part in content):
                raise BadRequest(f"messages[{number - 1}].content: only text parts are supported")
            content = "".join(part["text"] for part in content)
        calls = turn.get("tool_calls") if turn["role"] == "assistant" else None
        if content is None and calls:
            content = ""
        if not isinstance(content, str):
            raise BadRequest(f"messages[{number - 1}].content: expected a string, not {type(content).__name__}")
        turns.append({"role": turn["role"], "content": content, **({"tool_calls": calls} if calls else {}),
                      **({"tool_call_id": turn["tool_call_id"]} if "tool_call_id" in turn else {})})
    if turns[-1]["role"] not in ("user", "tool"):
        raise BadRequest("messages: the last turn must be the user's or a tool's result, the one to answer")
    if any(turn["role"] == "tool" or "tool_calls" in turn for turn in turns):
        return turns  # calls and their results: checked as training data's are, by the version's objective
    order = [turn["role"] for turn in turns if turn["role"] != "system"]
    if turns[0]["role"] != "system" and "system" in (turn["role"] for turn in turns) or any(
            one == other for one, other in zip(order, order[1:], strict=False)):
        raise BadRequest("messages: roles out of order (an optional system turn first, then user and assistant "
                         "turns taking turns)")
    return turns


def check_greedy(body: dict[str, Any]) -> None:
    """Settings that would make a sampled answer are refused: the service's answers are `llmops predict`'s."""
    if body.get("n", 1) != 1:
        raise BadRequest("n: only one choice is answered")
    for name, greedy in (("temperature", 0), ("top_p", 1)):
        if body.get(name, greedy) != greedy:
            raise BadRequest(f"{name}: this service decodes greedily, as evaluation does: send {name}={greedy} or "
                             "leave it out")


def flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise BadRequest(f"{name}: expected true or false")
    return value


def max_tokens_of(body: dict[str, Any]) -> int | None:
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise BadRequest("max_tokens: expected a whole number of at least 1")
    return value


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def chat_completion(request_id: str, model: str, text: str, usage: dict[str, int], finish: str) -> dict[str, Any]:
    """A whole chat completion; a reply that calls tools (`<tool_call>{json}</tool_call>`, finished before the
    length limit) has them as the message's `tool_calls`, the rest of its text as content (null if none)."""
    calls = openai_calls(text) if finish == "stop" else None
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message, finish = {"role": "assistant", "content": CALL_TEXT.sub("", text).strip() or None,
                           "tool_calls": calls}, "tool_calls"
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": usage}


def chat_event(request_id: str, model: str, delta: dict[str, Any], reason: str | None = None, **extra: Any) -> str:
    """One chat-completion chunk as a server-sent event."""
    chunk = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
             "choices": [{"index": 0, "delta": delta, "finish_reason": reason}], **extra}
    return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"


def chat_chunks(request_id: str, model: str, text: str | None, usage: dict[str, int], finish: str,
                tool_calls: list[dict[str, Any]] | None = None, opened: bool = False) -> Iterator[str]:
    """The same completion as server-sent events: the role (unless `opened`), the text, the tool calls, the finish,
    then [DONE]. A streamed reply sends the role and the text's pieces as they are generated (serving/streaming.py),
    then these with `opened` and `text` the part not yet sent."""
    if not opened:
        yield chat_event(request_id, model, {"role": "assistant", "content": ""})
    if text:
        yield chat_event(request_id, model, {"content": text})
    if tool_calls:
        yield chat_event(request_id, model, {"tool_calls": [{"index": index, **call}
                                                            for index, call in enumerate(tool_calls)]})
    yield chat_event(request_id, model, {}, finish, usage=usage)
    yield "data: [DONE]\n\n"


def text_completion(request_id: str, model: str, text: str, usage: dict[str, int], finish: str) -> dict[str, Any]:
    """A whole text completion."""
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}], "usage": usage}


def completion_event(request_id: str, model: str, piece: str, reason: str | None = None, **extra: Any) -> str:
    """One text-completion chunk as a server-sent event."""
    chunk = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
             "choices": [{"index": 0, "text": piece, "logprobs": None, "finish_reason": reason}], **extra}
    return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"


def completion_chunks(request_id: str, model: str, text: str, usage: dict[str, int], finish: str) -> Iterator[str]:
    """The same text completion as server-sent events: the text (a streamed one: the part not yet sent), the finish
    with the usage, then [DONE]."""
    if text:
        yield completion_event(request_id, model, text)
    yield completion_event(request_id, model, "", finish, usage=usage)
    yield "data: [DONE]\n\n"


def error_event(message: str, status: int) -> str:
    """A failure after a stream began, as its last event (OpenAI's shape: an error object)."""
    return f"data: {json.dumps(error_body(message, status), ensure_ascii=False)}\n\n"


def models_list(model: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "llmops"}]}


def error_body(message: str, status: int) -> dict[str, Any]:
    kind = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
            503: "overloaded_error"}.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "code": status}}
