"""The service's requests read back from MLflow: one record per traced request, with its feedback.

The service traces each sampled request in the `<experiment>-serving` experiment (serving/telemetry.py):
the root span holds the request, the answer (or only their sizes, when redacted), the version that
answered (`model_version`, NAME/N), latency, token counts and whether the prompt was cut; feedback
and corrections are assessments on the trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmops.config.schema import TrackingConfig
from llmops.io.errors import UserError
from llmops.tracking.log import client, serving_tracking

# traces read per page from the store
PAGE = 500


class MonitorError(UserError, RuntimeError):
    """Monitoring cannot read what it needs; the message says why."""


@dataclass(frozen=True)
class Assessed:
    name: str
    value: Any
    at_ms: int


@dataclass(frozen=True)
class ServedRequest:
    trace_id: str
    version: str
    at_ms: int
    ok: bool
    endpoint: str
    inputs: dict[str, Any]
    outputs: dict[str, Any]
    latency_ms: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    truncated: bool = False
    assessments: tuple[Assessed, ...] = field(default=())

    @property
    def redacted(self) -> bool:
        """Whether the service kept only the sizes of what was asked (`--redact`)."""
        return any(isinstance(value, dict) and set(value) == {"characters"} for value in self.inputs.values())

    def rated(self, name: str) -> Any:
        """The newest assessment of that name (a score, a label, a correction, a preferred answer), or None."""
        found = [assessed for assessed in self.assessments if assessed.name == name]
        return max(found, key=lambda assessed: assessed.at_ms).value if found else None


def served_requests(tracking_config: TrackingConfig, name: str, since_ms: int) -> list[ServedRequest]:
    """The traced requests of model `name`'s versions since `since_ms` (epoch milliseconds), oldest first."""
    serving = serving_tracking(tracking_config)
    try:
        mlflow_client = client(serving)
        experiment = mlflow_client.get_experiment_by_name(serving.experiment)
    except Exception as err:  # the store does not answer: nothing to read, said in one line
        raise MonitorError(f"tracking store: {str(err).splitlines()[0]}") from None
    if experiment is None:
        return []
    found: list[ServedRequest] = []
    token = None
    while True:
        page = mlflow_client.search_traces(
            locations=[experiment.experiment_id],
            max_results=PAGE,
            page_token=token,
            filter_string=f"trace.timestamp_ms >= {since_ms}",
        )
        found.extend(
            request
            for request in map(served_request, page)
            if request is not None and request.version.startswith(f"{name}/")
        )
        token = getattr(page, "token", None)
        if not token:
            return sorted(found, key=lambda request: request.at_ms)


def served_request(trace: Any) -> ServedRequest | None:
    """A trace the service wrote as a record; None for a trace of something else."""
    spans = trace.data.spans
    root = next((span for span in spans if span.parent_id is None), spans[0] if spans else None)
    if root is None or not isinstance(root.attributes.get("model_version"), str):
        return None
    attributes = root.attributes
    info = trace.info
    return ServedRequest(
        trace_id=info.trace_id,
        version=attributes["model_version"],
        at_ms=int(info.request_time),
        ok=str(getattr(info.state, "value", info.state)) == "OK",
        endpoint=root.name,
        inputs=root.inputs if isinstance(root.inputs, dict) else {},
        outputs=root.outputs if isinstance(root.outputs, dict) else {},
        latency_ms=number(attributes.get("latency_ms")),
        prompt_tokens=int(attributes.get("prompt_tokens") or 0),
        completion_tokens=int(attributes.get("completion_tokens") or 0),
        truncated=bool(attributes.get("prompt_truncated")),
        assessments=tuple(
            Assessed(assessment.name, assessed_value(assessment), int(assessment.create_time_ms or 0))
            for assessment in (info.assessments or [])
        ),
    )


def assessed_value(assessment: Any) -> Any:
    for part in ("feedback", "expectation"):
        holder = getattr(assessment, part, None)
        if holder is not None:
            return holder.value
    return getattr(assessment, "value", None)


def number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
