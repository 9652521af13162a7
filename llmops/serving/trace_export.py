"""The replica's trace writer: finished traces go to the tracking store in batches, on a thread of its own.

MLflow's own exporter writes each trace in two transactions (its spans, then its info), some 20 ms
of CPU a trace on a SQLite store: on a small machine that, not the model, bounded a traced service.
Here a request only appends its record to a bounded buffer; the writer hands up to `BATCH` of them
at a time to the store's span ingestion (`log_spans`, the OTLP path the MLflow server takes too),
which creates each trace from its root span in one transaction for the whole batch (about 2 ms a
trace, measured). The traces are complete MLflow traces: `search_traces`, the UI and assessments
read them as any other.

A store that does not answer never reaches a request: the writer keeps what it holds and tries
again with a growing pause, says so once when the store goes away and once when it is back. What
overflows the buffer (the oldest first) and what the store refuses outright are counted in
`llmops_traces_dropped_total`, never lost silently.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from llmops.io.errors import first_line

log = logging.getLogger("llmops.serve")
# traces written in one transaction; and how long a partial batch waits for more
BATCH = 64
GATHER_SECONDS = 0.2
# traces kept while the store does not answer (a few KiB each): past it the oldest go, counted
CAPACITY = 20_000
# tries of a batch the store refuses while it answers, then it is dropped and counted
TRIES = 3
RETRY_SECONDS = 0.5
LONGEST_PAUSE = 30.0
# MLflow's span type of each endpoint's trace
SPAN_TYPES = {"chat.completions": "CHAT_MODEL", "completions": "LLM"}


@dataclass
class Record:
    """One request's trace as the replica saw it (redacted already, where it is): made a span by the writer's thread,
    not the request's. Its span id is fixed, so that a batch sent again overwrites what a first try stored."""

    trace_id: str
    name: str  # the endpoint: chat.completions, completions or predict
    inputs: dict[str, Any]
    attributes: dict[str, Any]
    outputs: dict[str, Any] | None = None
    error: str | None = None
    start_ns: int = field(default_factory=time.time_ns)
    end_ns: int = 0
    span_id: int = field(default_factory=lambda: uuid.uuid4().int >> 64)


def new_trace_id() -> str:
    """An MLflow trace id ("tr-" and the 128-bit OpenTelemetry trace id in hex), known before the trace is written."""
    return f"tr-{uuid.uuid4().hex}"


class TraceWriter:
    """Writes records to one experiment of a tracking store in batches (see the module's docstring)."""

    def __init__(self, tracking_uri: str, experiment: str, dropped: Any, queued: Any) -> None:
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.dropped = dropped
        self.queued = queued
        self.held: deque[Record] = deque()
        self.changed = threading.Condition()
        # records taken in, and those done with (written or dropped): a flush waits for those before it only
        self.taken_in = 0
        self.done = 0
        self.hurrying = 0  # flushes waiting: a partial batch goes at once
        self.down = False
        self.closed = False
        self.thread: threading.Thread | None = None
        self.client: Any = None

    def put(self, record: Record) -> None:
        with self.changed:
            if self.closed:
                self.lose(1)
                return
            if len(self.held) >= CAPACITY:
                self.held.popleft()
                self.lose(1)
            self.held.append(record)
            self.taken_in += 1
            self.queued.set(len(self.held))
            if self.thread is None or not self.thread.is_alive():  # started by the first trace
                self.thread = threading.Thread(target=self.run, name="llmops-trace-writer", daemon=True)
                self.thread.start()
            if len(self.held) >= BATCH:
                self.changed.notify_all()

    def lose(self, count: int) -> None:
        """Count records dropped (the caller holds the lock)."""
        if count:
            self.dropped.inc(count)
            self.done += count

    def flush(self, seconds: float) -> int:
        """Write the records taken in before this call, waiting at most `seconds`: how many of them are left."""
        deadline = time.monotonic() + seconds
        with self.changed:
            target = self.taken_in
            self.hurrying += 1
            self.changed.notify_all()
            try:
                while self.done < target and time.monotonic() < deadline:
                    self.changed.wait(timeout=min(0.1, max(0.0, deadline - time.monotonic())))
            finally:
                self.hurrying -= 1
            return max(0, target - self.done)

    def close(self, seconds: float) -> int:
        """Write what is held, waiting at most `seconds` (the replica is stopping); what is left is dropped, counted,
        and so is a batch in flight that the store then does not take: the number dropped here."""
        self.flush(seconds)
        with self.changed:
            self.closed = True
            left = len(self.held)
            self.held.clear()
            self.lose(left)
            self.queued.set(0)
            return left

    def run(self) -> None:
        pause = 0.0
        while True:
            try:
                pause = self.step(pause)
            except Exception:  # a defect here must not end tracing for the replica's life: said, then go on
                log.exception("the trace writer failed; it goes on")
                pause = 1.0

    def step(self, pause: float) -> float:
        """One batch: gathered, written or put back; the pause before the next."""
        with self.changed:
            # a full batch, or a flush waiting, goes at once; while the store is away the pause holds (a flush
            # shortens it to a second)
            self.changed.wait_for(lambda: (len(self.held) >= BATCH or self.hurrying > 0) and not self.down,
                                  timeout=GATHER_SECONDS + (min(pause, 1.0) if self.hurrying else pause))
            taken = [self.held.popleft() for _ in range(min(BATCH, len(self.held)))]
        written = self.write(taken) if taken else True
        with self.changed:
            if written:
                self.done += len(taken)
            elif self.closed:  # the replica is stopping: nothing will try again
                self.lose(len(taken))
            else:  # the store is away: the batch goes back in front, in its order, the oldest dropped past capacity
                room = max(0, CAPACITY - len(self.held))
                self.lose(len(taken) - min(room, len(taken)))
                self.held.extendleft(reversed(taken[len(taken) - room:] if room < len(taken) else taken))
            self.queued.set(len(self.held))
            self.changed.notify_all()
        return 0.0 if written else min(LONGEST_PAUSE, max(1.0, 2 * pause))

    def write(self, records: list[Record]) -> bool:
        """Whether the batch is done with: written, or refused by a store that answers (then counted as dropped).
        Records that cannot be made spans are dropped and counted on the way, and taken out of `records`."""
        spans = self.spans(records)
        for attempt in range(TRIES):
            try:
                self.tracing().log_spans(self.experiment, spans)
            except Exception as err:
                failure = first_line(err) or type(err).__name__
                forget_server_version()  # MLflow keeps a failed version lookup, and with it "not supported"
                if not self.answers():
                    return self.went_away(failure)
                if attempt + 1 == TRIES:
                    log.warning("the tracking store refused %d traces: %s", len(spans), failure)
                    self.dropped.inc(len(spans))  # done with: the caller counts them so, with the batch
                    return True
                time.sleep(RETRY_SECONDS * (attempt + 1))
                continue
            if self.down:
                self.down = False
                log.warning("the tracking store answers again: the traces kept meanwhile are being written")
            return True
        return True

    def spans(self, records: list[Record]) -> list[Any]:
        """The records as spans. One that cannot be made a span (its values) is dropped alone, counted and said, and
        taken out of `records`, which go back to the buffer if the store is away."""
        spans, kept = [], []
        for record in records:
            try:
                spans.append(mlflow_span(record))
            except Exception as err:
                log.warning("trace %s not written: %s", record.trace_id, first_line(err) or type(err).__name__)
                with self.changed:
                    self.lose(1)
                continue
            kept.append(record)
        records[:] = kept
        return spans

    def went_away(self, failure: str) -> bool:
        if not self.down:
            self.down = True
            log.warning("the tracking store does not answer (%s): traces are kept, at most %d, until it does",
                        failure, CAPACITY)
        return False

    def answers(self) -> bool:
        try:
            self.tracing().store.get_experiment(self.experiment)
        except Exception:
            return False
        return True

    def tracing(self) -> Any:
        if self.client is None:
            from mlflow.tracing.client import TracingClient

            self.client = TracingClient(self.tracking_uri)
        return self.client


def mlflow_span(record: Record) -> Any:
    """The record as an MLflow root span: what `search_traces`, the UI and `llmops monitor` read."""
    from mlflow.entities import Span
    from mlflow.tracing.constant import SpanAttributeKey, TraceTagKey
    from mlflow.tracing.utils import build_otel_context
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.trace import Status, StatusCode

    attributes = {SpanAttributeKey.REQUEST_ID: record.trace_id,
                  SpanAttributeKey.SPAN_TYPE: SPAN_TYPES.get(record.name, "UNKNOWN"),
                  SpanAttributeKey.INPUTS: record.inputs, **record.attributes,
                  # the trace's name, as MLflow's own exporter sets it (a root span's trace tag)
                  f"{SpanAttributeKey.TRACE_TAG_PREFIX}{TraceTagKey.TRACE_NAME}": record.name}
    if record.outputs is not None:
        attributes[SpanAttributeKey.OUTPUTS] = record.outputs
    if "prompt_tokens" in record.attributes:  # the trace's token counts, as MLflow's UI shows them
        read, written = record.attributes["prompt_tokens"], record.attributes.get("completion_tokens", 0)
        attributes[SpanAttributeKey.CHAT_USAGE] = {"input_tokens": read, "output_tokens": written,
                                                   "total_tokens": read + written}
    trace = int(record.trace_id.removeprefix("tr-"), 16)
    status = Status(StatusCode.ERROR, record.error) if record.error is not None else Status(StatusCode.OK)
    events = ([Event("exception", {"exception.message": record.error}, timestamp=record.end_ns)]
              if record.error is not None else [])
    return Span(ReadableSpan(
        name=record.name, context=build_otel_context(trace, record.span_id), parent=None,
        start_time=record.start_ns, end_time=record.end_ns or time.time_ns(),
        attributes={key: json.dumps(value, default=str, ensure_ascii=False) for key, value in attributes.items()},
        status=status, events=events, resource=Resource.get_empty()))


def forget_server_version() -> None:
    """MLflow's REST store remembers a failed server-version lookup for good, and then refuses spans as "not
    supported": a server that was down at the first try would never be written to again."""
    from mlflow.store.tracking.rest_store import RestStore

    cached = getattr(RestStore._get_server_version, "cache_clear", None)
    if cached is not None:
        cached()
