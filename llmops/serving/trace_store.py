"""Where a replica's traces are written: a process of their own, beside the replica.

Making MLflow spans and writing them (SQLAlchemy on a SQLite or Postgres store, HTTP to a server)
is Python work: on the replica's thread it took about a quarter of the interpreter lock that
generation and the HTTP routes need (measured at 16 clients: 84 req/s traced, 110 untraced). So
the trace writer (serving/trace_export.py) hands each batch of records to this process and waits,
without the lock, for its outcome. One try a batch; the writer decides what a failure costs.

The process reads pickled batches on its stdin and answers each with a pickled Outcome on its
stdout (its own output goes to stderr, the replica's log). It ends when its stdin closes: when the
replica closes it, or when the replica's process ends in any way, killed included.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import IO, Any

from llmops.io.errors import first_line

log = logging.getLogger("llmops.serve")
# MLflow's span type of each endpoint's trace
SPAN_TYPES = {"chat.completions": "CHAT_MODEL", "completions": "LLM"}
# how long a closing replica waits for the process to end before it is killed
END_SECONDS = 5.0


@dataclass
class Record:
    """One request's trace as the replica saw it (redacted already, where it is): made a span by the store process,
    not the request's thread. Its span id is fixed, so that a batch sent again overwrites what a first try stored."""

    trace_id: str
    name: str  # the endpoint: chat.completions, completions or predict
    inputs: dict[str, Any]
    attributes: dict[str, Any]
    outputs: dict[str, Any] | None = None
    error: str | None = None
    start_ns: int = field(default_factory=time.time_ns)
    end_ns: int = 0
    span_id: int = field(default_factory=lambda: uuid.uuid4().int >> 64)
    size: int = 0  # bytes of its text, as the trace writer's buffer counts them


def new_trace_id() -> str:
    """An MLflow trace id ("tr-" and the 128-bit OpenTelemetry trace id in hex), known before the trace is written."""
    return f"tr-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Outcome:
    """One try of a batch: "written", "refused" (the store answers but did not take it) or "down" (it does not
    answer); and the records that could not be made spans (trace id, why), left out of the try."""

    status: str
    failure: str = ""
    unmade: tuple[tuple[str, str], ...] = ()


class StoreProcess:
    """The replica's side: starts the process with the writer, and again at a batch after it ended."""

    def __init__(self, tracking_uri: str, experiment: str) -> None:
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.process: subprocess.Popen[bytes] | None = None
        self.lock = threading.Lock()  # one batch in flight: the writer's thread, or a close
        self.closed = False

    def start(self) -> None:
        """Start the process now: its imports take seconds on a busy machine, and are then done before the first
        batch (a request's feedback waits for that batch)."""
        with self.lock:
            if not self.closed:
                self.started()

    def write(self, records: list[Record]) -> Outcome:
        with self.lock:
            if self.closed:
                return Outcome("refused", "the replica is stopping")
            try:
                process = self.started()
                pickle.dump(records, process.stdin)  # type: ignore[arg-type]
                process.stdin.flush()  # type: ignore[union-attr]
                return pickle.load(process.stdout)  # type: ignore[arg-type]
            except Exception as err:  # the channel broke (the process ended, or answered garbage): a fresh one next
                ended = self.end()
                return Outcome("refused", f"the trace process ended ({ended or first_line(err)})")

    def started(self) -> subprocess.Popen[bytes]:
        if self.process is not None and self.process.poll() is not None:
            self.end()  # it ended between batches: its pipes are closed before a fresh one starts
        if self.process is None:
            # the replica's own imports, wherever Ray put them (a runtime environment's folders)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
            self.process = subprocess.Popen([sys.executable, "-m", "llmops.serving.trace_store"],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
            pickle.dump((self.tracking_uri, self.experiment), self.process.stdin)  # type: ignore[arg-type]
        return self.process

    def close(self) -> None:
        self.closed = True
        if self.lock.acquire(timeout=END_SECONDS):
            try:
                self.end()
            finally:
                self.lock.release()
        elif self.process is not None:  # a batch still in flight after the flush: the store hangs, so it goes
            self.process.kill()

    def end(self) -> str:
        """End the process (closing its stdin ends it); how it ended, where it had."""
        process, self.process = self.process, None
        if process is None:
            return ""
        for pipe in (process.stdin, process.stdout):
            with contextlib.suppress(OSError):
                pipe.close()  # type: ignore[union-attr]
        try:
            code = process.wait(END_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait()
        return f"exit {code}" if code else ""


def attempt(client: Any, experiment: str, records: list[Record]) -> Outcome:
    """Write the batch once: the records as spans, through the store's span ingestion (`log_spans`, the OTLP path
    the MLflow server takes too), one transaction for the batch."""
    spans, unmade = [], []
    for record in records:
        try:
            spans.append(mlflow_span(record))
        except Exception as err:
            unmade.append((record.trace_id, first_line(err) or type(err).__name__))
    if not spans:
        return Outcome("written", unmade=tuple(unmade))
    try:
        client.log_spans(experiment, spans)
    except Exception as err:
        forget_server_version()  # MLflow keeps a failed version lookup, and with it "not supported"
        status = "refused" if answers(client, experiment) else "down"
        return Outcome(status, first_line(err) or type(err).__name__, tuple(unmade))
    return Outcome("written", unmade=tuple(unmade))


def answers(client: Any, experiment: str) -> bool:
    try:
        client.store.get_experiment(experiment)
    except Exception:
        return False
    return True


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


def serve(asked: IO[bytes], answered: IO[bytes]) -> None:
    """The process's loop: a batch in, its outcome out, until the replica closes `asked`."""
    tracking_uri, experiment = pickle.load(asked)
    client, failure = connected(tracking_uri)  # before the first batch, while the replica loads its model
    while True:
        try:
            records = pickle.load(asked)
        except EOFError:
            return
        if client is None:
            client, failure = connected(tracking_uri)
        pickle.dump(Outcome("down", failure) if client is None else attempt(client, experiment, records), answered)
        answered.flush()


def connected(tracking_uri: str) -> tuple[Any, str]:
    """The store's client, or why there is none: a store that cannot be opened is "down" to the writer, which keeps
    the batch and tries again later (a process that ended would cost the batch after three tries)."""
    from mlflow.tracing.client import TracingClient

    try:
        return TracingClient(tracking_uri), ""
    except Exception as err:
        return None, first_line(err) or type(err).__name__


def main() -> None:
    # the answers' channel is the stdout this process was given; anything printed goes to stderr instead
    answered = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    with contextlib.suppress(BrokenPipeError, KeyboardInterrupt):  # the replica ended while a batch was written
        serve(sys.stdin.buffer, answered)


if __name__ == "__main__":
    # run as the module the replica imports, so that what it unpickles names the same classes
    from llmops.serving import trace_store

    trace_store.main()
