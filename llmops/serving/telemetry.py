"""What a replica records: an MLflow trace per request with its feedback (its Prometheus metrics: serving/metrics.py).

A trace holds the request and its answer (or, redacted, only their sizes), the version that
answered, latency, prompt and completion tokens, whether the prompt was cut, and the error of a
request that failed. A request only hands its record to the replica's trace writer
(serving/trace_export.py), which writes traces in batches through a process of its own: a tracking store
that is down never blocks or fails a request, and what the writer cannot keep is counted
(`llmops_traces_dropped_total`). What is still held when Ray Serve stops a replica is written before
it ends (a Ray worker runs no exit handlers). Feedback is an MLflow assessment on the request's
trace: a score, a label or a preferred answer as feedback, a correction as an expectation.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from llmops.config.schema import TrackingConfig
from llmops.io.errors import first_line
from llmops.serving.metrics import Metrics
from llmops.serving.openai_api import BadRequest
from llmops.serving.trace_export import TraceWriter
from llmops.serving.trace_store import Record, new_trace_id
from llmops.store.settings import registry_uri, tracking_uri
from llmops.tracking.log import experiment_id, serving_tracking

log = logging.getLogger("llmops.serve")
FEEDBACK_KINDS = {"score": (int, float), "label": (str, bool, int), "correction": (str,), "preferred": (str,)}
# how long feedback waits for its trace to reach the store (traces are written in the background): a trace another
# replica wrote, or one this replica still holds (then longer: it is known, only not written yet)
TRACE_WAIT_SECONDS = 10.0
HELD_WAIT_SECONDS = 60.0
# how long a stopping replica waits for its held traces to be written
FLUSH_SECONDS = 30.0


@dataclass
class Span:
    """One request's trace, or a stand-in when the request is not sampled (it still has an id)."""

    request_id: str
    record: Record | None = None
    started: float = 0.0
    redact: bool = False

    def finish(self, outputs: dict[str, Any], usage: dict[str, Any], truncated: bool) -> None:
        if self.record is None:
            return
        self.record.outputs = sizes(outputs) if self.redact else outputs
        self.record.attributes.update({"latency_ms": round(1000 * (time.perf_counter() - self.started), 1),
                                       "prompt_truncated": truncated, **usage})


class Tracer:
    def __init__(self, tracking_config: TrackingConfig, metrics: Metrics, redact: bool, traced: bool = True) -> None:
        import mlflow

        self.metrics = metrics
        self.redact = redact
        uri = tracking_uri(tracking_config)
        mlflow.set_tracking_uri(uri)
        mlflow.set_registry_uri(registry_uri(tracking_config))
        self.writer: TraceWriter | None = None
        try:  # the project's experiment logic: a local store keeps the traces' artifacts beside it, not in ./mlruns
            self.experiment = experiment_id(serving_tracking(tracking_config))
        except Exception as err:  # a store down at start: the service answers, untraced, and says so
            log.warning("tracing is off: the tracking store does not answer (%s)", first_line(err))
            self.experiment = None
            return
        if traced:  # a sampling rate of 0 makes no writer, nor its store process
            self.writer = TraceWriter(uri, self.experiment, metrics.dropped, metrics.traces_held)

    @contextmanager
    def span(self, name: str, label: str, inputs: dict[str, Any], sampled: bool) -> Iterator[Span]:
        if not sampled or self.writer is None:
            yield Span(request_id=f"req-{new_trace_id().removeprefix('tr-')}")
            return
        # redacted at once: the words are not held while the trace waits for the store
        record = Record(trace_id=new_trace_id(), name=name,
                        inputs=sizes(inputs) if self.redact else inputs, attributes={"model_version": label})
        span = Span(request_id=record.trace_id, record=record, started=time.perf_counter(), redact=self.redact)
        try:
            yield span
        except BaseException as err:
            record.error = f"{type(err).__name__}: {first_line(err)}".rstrip(": ")
            raise
        finally:
            record.end_ns = time.time_ns()
            self.writer.put(record)

    def close(self) -> None:
        """Write what is still held (the replica is stopping): the traces of answered requests are kept."""
        if self.writer is None:
            return
        left = self.writer.close(FLUSH_SECONDS)
        if left:
            log.warning("%d traces still held were not written: the tracking store does not answer", left)

    def feedback(self, body: dict[str, Any]) -> dict[str, Any]:
        """Record {request_id, score|label|correction|preferred} on the request's trace."""
        request_id = body.get("request_id")
        given = [assessed for assessed in FEEDBACK_KINDS if assessed in body]
        if not isinstance(request_id, str) or len(given) != 1 or set(body) - {"request_id", *given, "comment"}:
            raise BadRequest('expected {"request_id": ..., and one of "score", "label", "correction", "preferred"}')
        assessed = given[0]
        value = body[assessed]
        if not isinstance(value, FEEDBACK_KINDS[assessed]) or assessed == "score" and isinstance(value, bool):
            raise BadRequest(f"{assessed}: expected {' or '.join(t.__name__ for t in FEEDBACK_KINDS[assessed])}")
        if not self.trace_exists(request_id):
            raise BadRequest(f"request_id {request_id!r}: no traced request has it", status=404)
        import mlflow
        from mlflow.entities import AssessmentSource

        source = AssessmentSource(source_type="HUMAN", source_id="llmops-serve")
        if assessed == "correction":
            mlflow.log_expectation(trace_id=request_id, name="correction", value=value, source=source)
        else:
            mlflow.log_feedback(trace_id=request_id, name=assessed, value=value, source=source,
                                rationale=body.get("comment"))
        return {"request_id": request_id, "recorded": assessed}

    def trace_exists(self, request_id: str) -> bool:
        """Whether the store holds the trace, waiting a little for the background writer."""
        import mlflow

        if not request_id.startswith("tr-"):
            return False
        if self.writer is not None and self.writer.holds(request_id):  # this replica's, not written yet
            self.writer.flush(HELD_WAIT_SECONDS)
            if self.writer.holds(request_id):
                raise BadRequest(f"request_id {request_id!r}: its trace is not written yet (the tracking store is "
                                 "slow or does not answer); try again later", status=503, retry_after=30)
        deadline = time.monotonic() + TRACE_WAIT_SECONDS
        while True:
            try:
                if mlflow.get_trace(request_id) is not None:
                    return True
            except Exception as err:  # not found, or the store does not answer: wait, then say not found
                log.debug("trace %s not found yet: %s", request_id, err)
            if time.monotonic() > deadline:
                return False
            time.sleep(0.25)


def sizes(values: dict[str, Any]) -> dict[str, Any]:
    """A redacted record: how much was asked and answered, not the words."""
    import json

    return {name: {"characters": len(json.dumps(value, ensure_ascii=False))} for name, value in values.items()}
