"""Replies streamed as they are generated, from the batched generate call that answers several clients at once.

Ray Serve's dynamic batching answers the requests of several clients in one `model.generate` call
(service.py `answer_batch`). A BatchStreamer, handed that call's tokens step by step, gives each row
that streams its new text as soon as it is settled: text that later tokens cannot change. Held back
are a trailing partial character ("\ufffd", a multi-byte character not yet whole), trailing
whitespace (a chat reply is stripped at the end; a tokenizer's clean-up may drop a space before
punctuation) and a tool call from its opening tag on (it is sent as `tool_calls`, not as text). So
what a row sends is always the start of its final text; the rest is sent once the answer is complete.
A row stops at its end-of-sequence token. Each request's pieces reach its event loop through a queue
(`call_soon_threadsafe`: generation runs on a worker thread), and `events` writes them as the
server-sent events of a chat or text completion.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from llmops.io.errors import first_line
from llmops.objectives.tool_answers import CALL_OPEN
from llmops.serving import openai_api

log = logging.getLogger("llmops.serve")
Sink = Callable[[str], None]
# what a later token may still change at the end of a row's text: whitespace and partial characters
UNSETTLED_END = re.compile(r"[\s\ufffd]+\Z")


def settled(text: str, strip: bool) -> str:
    """The part of a row's decoded text so far that its final text starts with, whatever tokens follow."""
    if strip:
        text = text.lstrip()
    call = text.find(CALL_OPEN)
    if call >= 0:
        text = text[:call]
    else:  # a tail that may yet become the opening tag of a call
        for length in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
            if text.endswith(CALL_OPEN[:length]):
                text = text[:-length]
                break
    return UNSETTLED_END.sub("", text)


class BatchStreamer:
    """One generate call's rows, each streamed to its sink (None: a row that does not stream). transformers' streamer
    interface (`put`, `end`: what `generate` calls), without importing transformers where the service starts."""

    def __init__(self, tokenizer: Any, sinks: list[Sink | None], strip: bool) -> None:
        self.tokenizer, self.sinks, self.strip = tokenizer, sinks, strip
        self.ids: list[list[int]] = [[] for _ in sinks]
        self.sent = ["" for _ in sinks]
        self.ended = [sink is None for sink in sinks]
        self.prompt_seen = False

    def put(self, value: Any) -> None:
        """The prompt's ids first (skipped), then each step's new token of every row."""
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for row, tokens in enumerate(value.reshape(len(self.sinks), -1).tolist()):
            for token in tokens:
                if self.ended[row]:
                    break
                if token == self.tokenizer.eos_token_id:
                    self.ended[row] = True
                else:
                    self.ids[row].append(token)
            if self.ids[row] and self.sinks[row] is not None:
                self.send(row)

    def send(self, row: int) -> None:
        text = settled(self.tokenizer.decode(self.ids[row], skip_special_tokens=True), self.strip)
        sent = self.sent[row]
        if len(text) > len(sent) and text.startswith(sent):
            self.sent[row] = text
            self.sinks[row](text[len(sent):])  # type: ignore[misc]

    def end(self) -> None:
        """The rest of each row is sent with its complete answer."""


def streamers(tokenizer: Any, sinks: dict[int, Sink]) -> Callable[[list[Any], bool], BatchStreamer | None]:
    """What `Served.streamer` is for a batch whose requests (by id) stream to `sinks`: for the requests of one
    generate call, a BatchStreamer, or None where none of them streams."""
    def streamer(requests: list[Any], strip: bool) -> BatchStreamer | None:
        rows = [sinks.get(id(request)) for request in requests]
        return BatchStreamer(tokenizer, rows, strip) if any(sink is not None for sink in rows) else None

    return streamer


async def events(chatting: bool, request_id: str, label: str, pieces: asyncio.Queue[str],
                 answer: asyncio.Task[dict[str, Any]], failed: Callable[[int], None]) -> AsyncIterator[str]:
    """The server-sent events of a streamed completion: (the role,) each piece as it arrives, then, once `answer`
    (the whole completion's body) is done, the text not yet sent, the finish with the usage and [DONE]. A failure
    after the stream began is an error event (OpenAI's shape), counted by `failed(status)`."""
    if chatting:
        yield openai_api.chat_event(request_id, label, {"role": "assistant", "content": ""})
    sent = ""
    async for piece in arrived(pieces, answer):
        sent += piece
        yield (openai_api.chat_event(request_id, label, {"content": piece}) if chatting
               else openai_api.completion_event(request_id, label, piece))
    try:
        body = answer.result()
    except Exception as err:
        status = 504 if isinstance(err, TimeoutError) else 500
        if status == 500:
            log.error("a streamed answer failed", exc_info=err)
        failed(status)
        yield openai_api.error_event("no answer in time" if status == 504 else f"{type(err).__name__}: "
                                     f"{first_line(err)}", status)
        return
    choice = body["choices"][0]
    text = (choice["message"]["content"] if chatting else choice["text"]) or ""
    if not text.startswith(sent):  # a tokenizer whose decoding of more tokens rewrote earlier text
        log.warning("request %s: the streamed text is not the start of its answer", request_id)
    rest = text[len(sent):] if text.startswith(sent) else ""
    chunks = (openai_api.chat_chunks(request_id, label, rest, body["usage"], choice["finish_reason"],
                                     choice["message"].get("tool_calls"), opened=True) if chatting
              else openai_api.completion_chunks(request_id, label, rest, body["usage"], choice["finish_reason"]))
    for chunk in chunks:
        yield chunk


async def arrived(pieces: asyncio.Queue[str], answer: Awaitable[Any]) -> AsyncIterator[str]:
    """The pieces as they arrive, until the answer is done and every piece sent before it was taken."""
    waiting = asyncio.ensure_future(answer)
    while True:
        if not pieces.empty():
            yield pieces.get_nowait()
            continue
        if waiting.done():
            return
        getter = asyncio.ensure_future(pieces.get())
        try:
            await asyncio.wait({getter, waiting}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also where the client went away: a piece the getter was woken for stays queued
            if not getter.done():
                getter.cancel()
        if getter.done():  # a cancelled getter is not done until it runs again
            yield getter.result()
