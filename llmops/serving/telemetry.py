"""What a replica records: an MLflow trace per request with its feedback (its Prometheus metrics: serving/metrics.py).

A trace holds the request and its answer (or, redacted, only their sizes), the version that
answered, latency, prompt and completion tokens and whether the prompt was cut. MLflow exports
traces in the background: a tracking store that is down never blocks or fails a request; a trace
that could not be started or ended is counted (`llmops_traces_dropped_total`). What is still queued
when Ray Serve stops a replica is exported before it ends (a Ray worker runs no exit handlers, so
without it a stop under load lost 40% of the traces in a measured run). MLflow's queue is bounded
(MLFLOW_ASYNC_TRACE_LOGGING_MAX_QUEUE_SIZE): past it, MLflow itself discards a trace with a warning.
Feedback is an MLflow assessment on the request's trace: a score, a label or a preferred answer as
feedback, a correction as an expectation.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from llmops.config.schema import TrackingConfig
from llmops.io.errors import first_line
from llmops.serving.metrics import Metrics
from llmops.serving.openai_api import BadRequest
from llmops.store.settings import registry_uri, tracking_uri
from llmops.tracking.log import experiment_id, serving_tracking

log = logging.getLogger("llmops.serve")
FEEDBACK_KINDS = {"score": (int, float), "label": (str, bool, int), "correction": (str,), "preferred": (str,)}
# how long feedback waits for its trace to reach the store (traces are exported in the background)
TRACE_WAIT_SECONDS = 10.0


@dataclass
class Span:
    """One request's trace, or a stand-in when the request is not sampled (it still has an id)."""

    request_id: str
    handle: Any = None
    redact: bool = False
    started: float = field(default_factory=time.perf_counter)

    def finish(self, outputs: dict[str, Any], usage: dict[str, Any], truncated: bool) -> None:
        if self.handle is None:
            return
        self.handle.set_outputs(sizes(outputs) if self.redact else outputs)
        self.handle.set_attributes({"latency_ms": round(1000 * (time.perf_counter() - self.started), 1),
                                    "prompt_truncated": truncated, **usage})


class Tracer:
    def __init__(self, tracking_config: TrackingConfig, metrics: Metrics, redact: bool) -> None:
        import mlflow

        self.metrics = metrics
        self.redact = redact
        mlflow.set_tracking_uri(tracking_uri(tracking_config))
        mlflow.set_registry_uri(registry_uri(tracking_config))
        try:  # the project's experiment logic: a local store keeps the traces' artifacts beside it, not in ./mlruns
            self.experiment = experiment_id(serving_tracking(tracking_config))
        except Exception as err:  # a store down at start: the service answers, untraced, and says so
            log.warning("tracing is off: the tracking store does not answer (%s)", first_line(err))
            self.experiment = None

    @contextmanager
    def span(self, name: str, label: str, inputs: dict[str, Any], sampled: bool) -> Iterator[Span]:
        if not sampled or self.experiment is None:
            yield Span(request_id=f"req-{uuid.uuid4().hex}")
            return
        import mlflow

        try:
            handle = mlflow.start_span_no_context(name=name, span_type="CHAT_MODEL",
                                                  inputs=sizes(inputs) if self.redact else inputs,
                                                  attributes={"model_version": label},
                                                  experiment_id=self.experiment)
        except Exception as err:  # the trace is lost, never the request
            self.metrics.dropped.inc()
            log.debug("trace not started: %s", err)
            yield Span(request_id=f"req-{uuid.uuid4().hex}")
            return
        span = Span(request_id=handle.trace_id, handle=handle, redact=self.redact)
        status = "OK"
        try:
            yield span
        except BaseException:
            status = "ERROR"
            raise
        finally:
            try:
                handle.end(status=status)
            except Exception:  # the exporter's failure is counted, the answer stands
                self.metrics.dropped.inc()

    @staticmethod
    def flush() -> None:
        """Export what is still queued (the replica is stopping): the traces of answered requests are kept."""
        import mlflow

        try:
            mlflow.flush_trace_async_logging(terminate=True)
        except Exception as err:  # a store that is down: what is queued is lost, and said
            log.warning("traces still queued were not exported: %s", first_line(err))

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
        """Whether the store holds the trace, waiting a little for the background export."""
        import mlflow

        if not request_id.startswith("tr-"):
            return False
        deadline = time.monotonic() + TRACE_WAIT_SECONDS
        flush = True  # this replica's own pending traces first
        while True:
            try:
                if mlflow.get_trace(request_id, flush=flush) is not None:
                    return True
                flush = False
            except Exception as err:  # not found, or the store does not answer: wait, then say not found
                log.debug("trace %s not found yet: %s", request_id, err)
            if time.monotonic() > deadline:
                return False
            time.sleep(0.25)


def sizes(values: dict[str, Any]) -> dict[str, Any]:
    """A redacted record: how much was asked and answered, not the words."""
    import json

    return {name: {"characters": len(json.dumps(value, ensure_ascii=False))} for name, value in values.items()}
