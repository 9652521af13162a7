"""The service: a registered version behind an OpenAI-compatible API on Ray Serve, following its alias.

Each replica holds a Follower (serving/follow.py) and answers:
- POST /v1/chat/completions (with "stream": true as server-sent events, token by token: serving/streaming.py),
  POST /v1/completions (a raw prompt continued, no chat template), GET /v1/models: generative versions, batched
  across requests by Ray Serve's dynamic batching;
- POST /v1/predict: {"rows": [...]}, the rows `llmops predict` reads, answered as it answers (every
  objective: classifiers, taggers, QA, seq2seq, reward models, language models);
- POST /v1/feedback: {"request_id", "score" | "label" | "correction" | "preferred"}, recorded on that
  request's MLflow trace as an assessment;
- GET /health, GET /metrics (Prometheus text).
Every answer carries the header X-Model-Version: NAME/N (and a chat completion its `model`), and
X-Trace-Id, the id of its MLflow trace (the request_id feedback names; a completion's `id` too). A
replica answers 503 with Retry-After rather than let a request wait longer than `max_wait_seconds`
for its batch (from the batches it measures), and past `queue` requests in all, so latency and memory
stay bounded past saturation; every request has a timeout. Listening beyond loopback
requires an API key, checked on every request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import math
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, ClassVar

from llmops.config.schema import TrackingConfig
from llmops.serving import openai_api, streaming
from llmops.serving.follow import Follower
from llmops.serving.metrics import Metrics
from llmops.serving.openai_api import BadRequest
from llmops.serving.telemetry import Tracer

log = logging.getLogger("llmops.serve")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class ServeSettings:
    """What a replica needs: the reference it follows, where the registry is, and its limits."""

    reference: str
    tracking: TrackingConfig
    follow_seconds: float = 10.0
    max_batch: int = 16
    batch_wait_seconds: float = 0.01
    queue: int = 64
    max_wait_seconds: float = 0.5
    timeout_seconds: float = 120.0
    api_key: str | None = None
    trace_sample: float = 1.0
    redact: bool = False


@dataclass
class Pacing:
    """How long the next batch gathers requests before it closes.

    Ray Serve closes a batch `batch_wait_timeout_s` after its first request, then the batch waits its
    turn while the one before it runs. With a fixed short wait, batches close small and queue up behind
    the running one (measured: 3 requests a batch at 16 clients); with a fixed long wait, a lone client
    waits for nothing. So: when no batch runs, the next one waits only `least`. While one runs, the next
    gathers for as long as the running one has left, by the last batch's duration (the model is busy
    anyway), and lingers a little after it: requests that came in during generation are still being
    read, since the replica's event loop shares one interpreter lock with generation on a CPU.
    """

    least: float
    started: float | None = None
    last_seconds: float = 0.0
    typical_seconds: float = 0.0  # a moving average of batch durations: what a request waits per batch ahead
    # the linger: half the last batch's duration, at most 50 ms (a long GPU batch leaves the lock free)
    LINGER: ClassVar[float] = 0.5
    MOST_LINGER: ClassVar[float] = 0.05

    def wait(self, now: float) -> float:
        if self.started is None:
            return self.least
        remaining = self.last_seconds - (now - self.started)
        return max(self.least, remaining + min(self.LINGER * self.last_seconds, self.MOST_LINGER))

    def begin(self, now: float) -> None:
        self.started = now

    def end(self, now: float) -> None:
        if self.started is not None:
            self.last_seconds = now - self.started
            self.typical_seconds = (self.last_seconds if not self.typical_seconds
                                    else 0.8 * self.typical_seconds + 0.2 * self.last_seconds)
        self.started = None

    def expected_wait(self, pending: int, max_batch: int) -> float:
        """Seconds until a request joining `pending` others is answered: the batches ahead of it and its own."""
        return math.ceil((pending + 1) / max_batch) * self.typical_seconds


def check_access(host: str, api_key: str | None) -> None:
    """Beyond loopback, only with a key: a served model answers whoever reaches it."""
    if host not in LOOPBACK and not api_key:
        from llmops.io.errors import UserError

        raise UserError(f"--host {host} listens beyond this machine: give an API key (--api-key or "
                        "LLMOPS_API_KEY); every request must then send it as Authorization: Bearer KEY")


@dataclass(frozen=True)
class Asked:
    """A chat or completions request, read and checked: the version that answers it, as it is served to it (its
    length limit), the objective's request and the prompt's length in tokens against the model's limit."""

    endpoint: str  # "chat" or "completions"
    request: openai_api.ChatRequest
    live: Any
    served: Any
    parsed: Any
    prompt: int
    limit: int | None

    @property
    def chatting(self) -> bool:
        return self.endpoint == "chat"


class Replica:
    """One replica's work, apart from Ray and FastAPI (the deployment routes requests here)."""

    def __init__(self, settings: ServeSettings, follower: Follower | None = None) -> None:
        self.settings = settings
        self.follower = follower or Follower(settings.reference, settings.tracking)
        self.metrics = Metrics()
        self.tracer = Tracer(settings.tracking, self.metrics, settings.redact, traced=settings.trace_sample > 0)
        self.pacing = Pacing(settings.batch_wait_seconds)
        self.pending = 0
        self.metrics.serving(self.follower.live.label)

    def authorized(self, header: str | None) -> bool:
        key = self.settings.api_key
        return key is None or hmac.compare_digest((header or "").removeprefix("Bearer ").strip(), key)

    def refusal(self) -> float | None:
        """None where the replica takes one more request, else the seconds after which to ask again."""
        return refusal(self.pending, self.pacing, self.settings)

    async def follow(self) -> None:
        """Follow the alias for as long as the replica lives; loading happens off the event loop."""
        while self.follower.follows:
            await asyncio.sleep(self.settings.follow_seconds)
            await asyncio.to_thread(self.follower.poll)
            self.metrics.serving(self.follower.live.label)

    def asked(self, endpoint: str, raw: bytes) -> Asked:
        """A chat ("chat") or completions ("completions") body, read and checked against the live version before
        anything is generated or streamed: BadRequest naming what is wrong."""
        chatting = endpoint == "chat"
        body = openai_api.read_body(raw)
        request = openai_api.chat_request(body) if chatting else openai_api.completion_request(body)
        live = self.follower.live  # this request finishes on the version it started with
        served = live.loaded.served
        if request.max_tokens is not None and request.max_tokens < served.max_new_tokens:
            served = dataclasses.replace(served, max_new_tokens=request.max_tokens)
        parsed = self.parse(live, request.row, served)
        if ("prompt" if chatting else "prefix") not in parsed.fields:
            raise BadRequest(f"{live.label} does not {'chat' if chatting else 'complete text'}: POST its rows to "
                             "/v1/predict")
        prompt = prompt_tokens(live, parsed)
        limit = getattr(served.model.config, "max_position_embeddings", None)
        if limit and prompt >= limit:
            raise BadRequest(f"{'messages' if chatting else 'prompt'}: the prompt is {prompt} tokens; {live.label} "
                             f"reads at most {limit - 1}")
        return Asked(endpoint, request, live, served, parsed, prompt, limit)

    async def generated(self, asked: Asked, answer_rows: Any, sink: Any = None,
                        opened: asyncio.Future[str] | None = None) -> tuple[dict[str, Any], str, str]:
        """The completion's body, version label and request id; its text also goes to `sink` piece by piece as it is
        generated, and the request id to `opened` as soon as its trace begins."""
        live, served, chatting = asked.live, asked.served, asked.chatting
        sampled = random.random() < self.settings.trace_sample
        started = time.perf_counter()
        with self.tracer.span("chat.completions" if chatting else "completions", live.label, asked.request.row,
                              sampled) as span:
            if opened is not None:
                opened.set_result(span.request_id)
            answer = (await answer_rows([(live, served, asked.parsed, sink)]))[0]
            text = answer.get("output", "")
            usage = {"prompt_tokens": asked.prompt, "completion_tokens": answer["tokens"],  # as generated
                     "prompt_truncated": bool(asked.limit and asked.prompt + served.max_new_tokens > asked.limit)}
            finish = "length" if usage["completion_tokens"] >= served.max_new_tokens else "stop"
            span.finish({"output": text}, usage, truncated=usage["prompt_truncated"])
        self.metrics.answered(asked.endpoint, live.label, time.perf_counter() - started, usage)
        write = openai_api.chat_completion if chatting else openai_api.text_completion
        return write(span.request_id, live.label, text, public_usage(usage), finish), live.label, span.request_id

    async def streamed(self, asked: Asked, answer_rows: Any) -> tuple[str, asyncio.Task[Any], AsyncIterator[str]]:
        """Begin answering, streamed: (request id, the answer's task, its server-sent events). The task is the
        request's (the per-request timeout, the trace); the events only read it, so a client that goes away
        leaves the batch it is in, and the replica's count of requests, as they would be."""
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[str] = asyncio.Queue()
        opened: asyncio.Future[str] = loop.create_future()

        def sink(piece: str) -> None:  # called on the generation thread
            loop.call_soon_threadsafe(pieces.put_nowait, piece)

        async def body() -> dict[str, Any]:
            return (await self.generated(asked, answer_rows, sink, opened))[0]

        answer = loop.create_task(asyncio.wait_for(body(), self.settings.timeout_seconds))
        await asyncio.wait({answer, opened}, return_when=asyncio.FIRST_COMPLETED)
        if not opened.done():
            answer.result()  # raises what stopped it before its trace began
        stream = streaming.events(asked.chatting, opened.result(), asked.live.label, pieces, answer,
                                  lambda status: self.metrics.failed(asked.endpoint, status))
        return opened.result(), answer, stream

    async def predict(self, raw: bytes, answer_rows: Any) -> tuple[dict[str, Any], str, str]:
        """Rows as `llmops predict` reads them, answered as it answers: one result per row, errors as rows."""
        body = openai_api.read_body(raw)
        rows = body.get("rows")
        if set(body) - {"rows", "model"} or not isinstance(rows, list) or not rows:
            raise BadRequest('expected {"rows": [...]}, a non-empty list of rows as `llmops predict` reads them')
        live = self.follower.live
        sampled = random.random() < self.settings.trace_sample
        started = time.perf_counter()
        with self.tracer.span("predict", live.label, {"rows": rows}, sampled) as span:
            results: list[dict[str, Any] | None] = [None] * len(rows)
            work = []
            for line, row in enumerate(rows, 1):
                try:
                    if not isinstance(row, dict):
                        raise BadRequest("not a JSON object")
                    work.append((line, self.parse(live, row, live.loaded.served)))
                except BadRequest as err:
                    results[line - 1] = {"line": line, "error": str(err)}
            answers = await answer_rows([(live, live.loaded.served, request, None) for _, request in work])
            for (line, _), answer in zip(work, answers, strict=True):
                results[line - 1] = {"line": line, **answer}
            span.finish({"results": results}, {}, truncated=False)
        self.metrics.answered("predict", live.label, time.perf_counter() - started, {})
        return {"model": live.label, "results": results}, live.label, span.request_id

    @staticmethod
    def parse(live: Any, row: dict[str, Any], served: Any) -> Any:
        from llmops.objectives.base import RowError

        try:
            return live.loaded.objective.request(1, row, served)
        except RowError as err:
            raise BadRequest(str(err)) from None

    def feedback(self, raw: bytes) -> dict[str, Any]:
        return self.tracer.feedback(openai_api.read_body(raw))


def refusal(pending: int, pacing: Pacing, settings: ServeSettings) -> float | None:
    """None where a replica holding `pending` requests takes one more, else the seconds after which to ask again.

    Past saturation, a queue only adds waiting: throughput needs the running batch and the next one full, no
    more. So a request is refused once its expected wait passes `max_wait_seconds` (two full batches are always
    taken, however long a batch takes), and in any case past `queue` requests, which bounds memory.
    """
    wait = pacing.expected_wait(pending, settings.max_batch)
    if pending < settings.queue and (pending < 2 * settings.max_batch or wait <= settings.max_wait_seconds):
        return None
    return max(1.0, wait - settings.max_wait_seconds)


def answer_batch(items: list[tuple[Any, Any, Any, Any]]) -> list[dict[str, Any]]:
    """Answers for requests of several clients, in order: each group of one version and one length limit is one
    call of its objective (one padded batch through the model). An item is (version, served, request, sink): a
    request with a sink has its text streamed to it as it is generated (serving/streaming.py)."""
    results: list[dict[str, Any] | None] = [None] * len(items)
    groups: dict[tuple[int, int], list[int]] = {}
    for index, (live, served, _, _) in enumerate(items):
        groups.setdefault((id(live), served.max_new_tokens), []).append(index)
    for indexes in groups.values():
        live, served, _, _ = items[indexes[0]]
        sinks = {id(items[i][2]): items[i][3] for i in indexes if items[i][3] is not None}
        if sinks:
            served = dataclasses.replace(served, streamer=streaming.streamers(served.tokenizer, sinks))
        answers = live.loaded.objective.answer(served, [items[i][2] for i in indexes])
        for index, answer in zip(indexes, answers, strict=True):
            results[index] = answer
    return results  # type: ignore[return-value]


def prompt_tokens(live: Any, request: Any) -> int:
    """The prompt's tokens as generation reads them: through the chat template, with the generation prompt (a raw
    prefix as it is, from its BOS)."""
    from llmops.text.templates import render

    tokenizer = live.loaded.served.tokenizer
    if "prefix" in request.fields:
        return len(tokenizer(request.fields["prefix"], add_special_tokens=True)["input_ids"])
    rendered = render(tokenizer, request.fields["prompt"], generation_prompt=True, tools=request.fields.get("tools"))
    return len(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def public_usage(usage: dict[str, Any]) -> dict[str, int]:
    return {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
            "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]}
