"""The replica's trace writer against a real SQLite tracking store: traces written in batches are whole MLflow traces
(what `llmops monitor` and assessments read), errors and redaction are kept, and a store that answers but refuses
writes costs the batch, counted, not the writer."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import mlflow
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge

from llmops.monitoring.traces import served_request
from llmops.serving import trace_export
from llmops.serving.trace_export import Record, TraceWriter, new_trace_id

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture()
def store(tmp_path: Path) -> tuple[str, str]:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    return uri, mlflow.create_experiment("serving", artifact_location=str(tmp_path / "artifacts"))


def writer(uri: str, experiment: str) -> TraceWriter:
    registry = CollectorRegistry()
    return TraceWriter(uri, experiment, Counter("dropped", "", registry=registry), Gauge("held", "", registry=registry))


def record(number: int, **given: Any) -> Record:
    done = Record(trace_id=new_trace_id(), name="chat.completions", span_type="CHAT_MODEL",
                  inputs={"messages": [{"role": "user", "content": f"row {number} é"}]},
                  attributes={"model_version": "m/1"}, **given)
    done.outputs = done.outputs or {"output": f"answer {number}"}
    done.attributes.update({"latency_ms": 12.5, "prompt_tokens": 7, "completion_tokens": 3, "prompt_truncated": False})
    done.end_ns = time.time_ns()
    return done


def traces(experiment: str) -> dict[str, Any]:
    return {trace.info.trace_id: trace
            for trace in mlflow.search_traces(locations=[experiment], max_results=1000, return_type="list")}


def test_batched_traces_are_whole_mlflow_traces_that_monitoring_and_feedback_read(store: tuple[str, str]) -> None:
    uri, experiment = store
    written = writer(uri, experiment)
    records = [record(number) for number in range(150)]  # more than two batches
    for each in records:
        written.put(each)
    assert written.flush(60) == 0 and written.dropped._value.get() == 0
    found = traces(experiment)
    assert set(found) == {each.trace_id for each in records}
    request = served_request(found[records[5].trace_id])
    assert request is not None and request.ok and request.version == "m/1" and request.endpoint == "chat.completions"
    assert request.inputs == records[5].inputs and request.outputs == {"output": "answer 5"}
    assert (request.latency_ms, request.prompt_tokens, request.completion_tokens, request.truncated) == (12.5, 7, 3,
                                                                                                       False)
    assert found[records[5].trace_id].info.token_usage == {"input_tokens": 7, "output_tokens": 3, "total_tokens": 10}
    mlflow.log_feedback(trace_id=records[5].trace_id, name="score", value=1.0)
    assert served_request(mlflow.get_trace(records[5].trace_id)).rated("score") == 1.0


def test_a_failed_request_is_an_error_trace_and_redaction_keeps_only_sizes(store: tuple[str, str]) -> None:
    uri, experiment = store
    written = writer(uri, experiment)
    failed = record(1, error="TimeoutError: the request took longer than 120 s")
    redacted = record(2, redact=True)
    written.put(failed)
    written.put(redacted)
    assert written.flush(60) == 0
    found = traces(experiment)
    error = found[failed.trace_id]
    assert str(getattr(error.info.state, "value", error.info.state)) == "ERROR"
    assert [event.attributes["exception.message"] for event in error.data.spans[0].events] == [failed.error]
    assert served_request(error).ok is False
    secret = served_request(found[redacted.trace_id])
    assert secret.redacted and secret.inputs == {"messages": {"characters": len(json.dumps(redacted.inputs[
        "messages"], ensure_ascii=False))}} and "row 2" not in json.dumps(found[redacted.trace_id].data.to_dict())


def test_a_store_that_answers_but_refuses_costs_the_batch_counted_and_the_writer_goes_on(
        store: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    _, experiment = store
    monkeypatch.setattr(trace_export, "RETRY_SECONDS", 0.0)
    read_only = writer(f"sqlite:///file:{tmp_path / 'mlflow.db'}?mode=ro&uri=true", experiment)
    for number in range(5):
        read_only.put(record(number))
    with caplog.at_level(logging.WARNING, logger="llmops.serve"):
        assert read_only.flush(60) == 0
    assert read_only.dropped._value.get() == 5 and read_only.down is False and traces(experiment) == {}
    assert [line.getMessage().split(":")[0] for line in caplog.records] == ["the tracking store refused 5 traces"]
    unwritable = record(6)
    unwritable.trace_id = "tr-not-hex"  # its values cannot be a span: dropped alone, the rest of the batch written
    good = writer(*store)
    good.put(unwritable)
    good.put(record(7))
    assert good.flush(60) == 0 and good.dropped._value.get() == 1 and len(traces(experiment)) == 1


def test_while_the_store_is_away_the_writer_pauses_between_tries_however_much_it_holds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    away = writer(f"sqlite:///{tmp_path / 'no such folder' / 'mlflow.db'}", "1")
    tries: list[float] = []
    write = TraceWriter.write

    def counted(self: TraceWriter, records: list[Record]) -> bool:
        tries.append(time.monotonic())
        return write(self, records)

    monkeypatch.setattr(TraceWriter, "write", counted)
    for number in range(3 * trace_export.BATCH):  # three full batches held
        away.put(record(number))
    time.sleep(2.5)
    assert away.down and away.dropped._value.get() == 0 and away.queued._value.get() == 3 * trace_export.BATCH
    assert 1 <= len(tries) <= 3, len(tries)  # the first try, then pauses of 1 s and 2 s
    assert away.flush(0.5) == 3 * trace_export.BATCH  # nothing written, nothing lost
