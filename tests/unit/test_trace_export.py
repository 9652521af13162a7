"""The replica's trace writer against a real SQLite tracking store: traces written in batches are whole MLflow traces
(what `llmops monitor` and assessments read), errors and redaction are kept, and a store that answers but refuses
writes costs the batch, counted, not the writer."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlflow
import psutil
import pytest

from llmops.config.schema import TrackingConfig
from llmops.monitoring.traces import served_request
from llmops.serving import telemetry, trace_export
from llmops.serving.metrics import Metrics
from llmops.serving.openai_api import BadRequest
from llmops.serving.telemetry import Tracer
from llmops.serving.trace_export import TraceWriter
from llmops.serving.trace_store import Record, new_trace_id

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def database(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One SQLite store for the module (making its tables takes seconds); each test has an experiment of its own."""
    return tmp_path_factory.mktemp("store") / "mlflow.db"


@pytest.fixture()
def store(database: Path, request: pytest.FixtureRequest) -> tuple[str, str]:
    uri = f"sqlite:///{database}"
    mlflow.set_tracking_uri(uri)
    return uri, mlflow.create_experiment(request.node.name, artifact_location=str(database.parent / "artifacts"))


MADE: list[TraceWriter] = []


@pytest.fixture(autouse=True)
def store_processes_ended() -> Iterator[None]:
    yield
    while MADE:  # killed first: a process still importing reads its closed stdin only when its imports are done
        made = MADE.pop().store
        if made.process is not None:
            made.process.kill()
        made.close()


def writer(uri: str, experiment: str) -> TraceWriter:
    metrics = Metrics()  # a replica's own, as a replica alone keeps them
    MADE.append(TraceWriter(uri, experiment, metrics.dropped, metrics.traces_held))
    return MADE[-1]


def nowhere() -> str:
    """The address of a server that does not answer: a port nothing listens on."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{closed.getsockname()[1]}"


def record(number: int) -> Record:
    done = Record(trace_id=new_trace_id(), name="chat.completions",
                  inputs={"messages": [{"role": "user", "content": f"row {number} é"}]},
                  attributes={"model_version": "m/1"}, outputs={"output": f"answer {number}"})
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
    uri, _ = store
    metrics = Metrics()
    tracer = Tracer(TrackingConfig(tracking_uri=uri), metrics, redact=True)
    asked = {"messages": [{"role": "user", "content": "row 2 é"}]}
    with pytest.raises(TimeoutError), tracer.span("chat.completions", "m/1", asked, sampled=True) as failed:
        raise TimeoutError("the request took longer than 120 s")
    with tracer.span("chat.completions", "m/1", asked, sampled=True) as answered:
        answered.finish({"output": "secret answer"}, {"prompt_tokens": 7, "completion_tokens": 3}, truncated=False)
    assert answered.record.inputs == {"messages": {"characters": len(json.dumps(asked["messages"],
                                                                               ensure_ascii=False))}}
    tracer.close()
    assert metrics.dropped._value.get() == 0
    found = traces(tracer.experiment)
    error = found[failed.request_id]
    assert str(getattr(error.info.state, "value", error.info.state)) == "ERROR"
    assert [event.attributes["exception.message"] for event in error.data.spans[0].events] == [
        "TimeoutError: the request took longer than 120 s"]
    assert served_request(error).ok is False and error.info.tags["mlflow.traceName"] == "chat.completions"
    secret = served_request(found[answered.request_id])
    assert secret.redacted and secret.outputs == {"output": {"characters": len('"secret answer"')}}
    assert "row 2" not in json.dumps(found[answered.request_id].data.to_dict())
    assert "secret" not in json.dumps(found[answered.request_id].data.to_dict())


def test_a_store_that_answers_but_refuses_costs_the_batch_counted_and_the_writer_goes_on(
        store: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    _, experiment = store
    monkeypatch.setattr(trace_export, "RETRY_SECONDS", 0.0)
    monkeypatch.chdir(tmp_path)  # MLflow makes the folders of a "file:" database path, relative to here
    read_only = writer(f"sqlite:///file:{store[0].removeprefix('sqlite:///')}?mode=ro&uri=true", experiment)
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
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    away = writer(nowhere(), "1")
    tries: list[float] = []
    write = TraceWriter.write

    def counted(self: TraceWriter, records: list[Record]) -> bool:
        tries.append(time.monotonic())
        return write(self, records)

    monkeypatch.setattr(TraceWriter, "write", counted)
    for number in range(3 * trace_export.BATCH):  # three full batches held
        away.put(record(number))
    deadline = time.monotonic() + 60
    while not (away.down and away.queued._value.get() == 3 * trace_export.BATCH):
        assert time.monotonic() < deadline, "the writer never found the store away"
        time.sleep(0.1)
    before = len(tries)
    time.sleep(2.5)
    assert len(tries) - before <= 2, len(tries) - before  # pauses of 1 s, then 2 s: not a try per batch held
    assert away.dropped._value.get() == 0
    assert away.flush(0.5) == 3 * trace_export.BATCH  # nothing written, nothing lost
    assert away.close(0.5) == 3 * trace_export.BATCH and away.dropped._value.get() == 3 * trace_export.BATCH


def test_a_flush_waits_only_for_what_was_taken_in_before_it(store: tuple[str, str]) -> None:
    uri, experiment = store
    written = writer(uri, experiment)
    first = record(1)
    written.put(first)
    assert written.flush(60) == 0 and first.trace_id in traces(experiment)
    assert written.flush(0.0) == 0  # nothing taken in since: nothing to wait for
    sent_twice = record(2)  # a batch sent again (its reply lost) overwrites what the first try stored
    written.put(sent_twice)
    written.put(sent_twice)
    assert written.flush(60) == 0
    assert len(traces(experiment)[sent_twice.trace_id].data.spans) == 1


def test_a_store_process_that_ended_is_started_again_and_nothing_is_lost(store: tuple[str, str]) -> None:
    written = writer(*store)
    written.put(record(1))
    assert written.flush(60) == 0
    first = written.store.process
    assert first is not None and first.pid != os.getpid()  # written by a process of its own
    first.kill()
    first.wait()
    later = [record(number) for number in range(2, 6)]
    for each in later:
        written.put(each)
    assert written.flush(60) == 0 and written.dropped._value.get() == 0
    assert written.store.process is not None and written.store.process.pid != first.pid
    assert {each.trace_id for each in later} <= set(traces(store[1]))


def test_the_store_process_ends_with_the_replica_however_it_ends(store: tuple[str, str], tmp_path: Path) -> None:
    script = tmp_path / "replica.py"  # a replica's process, killed without a chance to close anything
    script.write_text(f"""
import sys, time
from llmops.serving.metrics import Metrics
from llmops.serving.trace_export import TraceWriter
from llmops.serving.trace_store import Record, new_trace_id
metrics = Metrics()
writer = TraceWriter({store[0]!r}, {store[1]!r}, metrics.dropped, metrics.traces_held)
writer.put(Record(trace_id=new_trace_id(), name="predict", inputs={{}}, attributes={{}}))
assert writer.flush(60) == 0
print(writer.store.process.pid, flush=True)
time.sleep(600)
""")
    replica = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(replica.stdout.readline())  # type: ignore[union-attr]
    finally:
        replica.send_signal(signal.SIGKILL)
        replica.wait()
    deadline = time.monotonic() + 10
    while alive(child):
        assert time.monotonic() < deadline, "the store process outlived its replica"
        time.sleep(0.1)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE  # a zombie has ended; its parent is gone
    except psutil.NoSuchProcess:
        return False


def test_the_buffer_is_bounded_in_bytes_too_and_keeps_the_newest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace_export, "GATHER_SECONDS", 60.0)  # the writer's thread takes no partial batch meanwhile
    records = [record(number) for number in range(10, 40)]  # of one size
    one = trace_export.record_bytes(records[0])
    monkeypatch.setattr(trace_export, "CAPACITY_BYTES", 10 * one + one // 2)
    held = writer("http://127.0.0.1:9", "1")  # nothing is written here
    for each in records[:25]:
        held.put(each)
    assert [kept.trace_id for kept in held.held] == [kept.trace_id for kept in records[15:25]]
    assert held.dropped._value.get() == 15 and held.held_bytes == 10 * one
    with held.changed:  # a batch the store did not take goes back in front, as much of it as fits, its newest
        taken = held.take(3)
    held.put(records[25])
    held.put(records[26])
    with held.changed:
        held.put_back(taken)
    assert [kept.trace_id for kept in held.held] == [kept.trace_id for kept in records[17:27]]
    assert held.dropped._value.get() == 17 and held.held_bytes == 10 * one


def test_the_store_process_starts_with_the_writer_and_a_store_it_cannot_open_then_is_waited_for(
        tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    away = writer(f"sqlite:///{blocked}/mlflow.db", "1")  # its folder is a file: the store cannot be opened
    assert away.store.process is not None and away.store.process.poll() is None  # started before any trace
    for number in range(3):
        away.put(record(number))
    deadline = time.monotonic() + 60
    while not away.down:  # the process said "down", it did not end: the records are kept, not tried and dropped
        assert time.monotonic() < deadline and away.dropped._value.get() == 0, "the writer never found the store away"
        time.sleep(0.1)
    assert away.flush(0.5) == 3 and away.dropped._value.get() == 0


def test_feedback_waits_for_a_trace_its_replica_holds_and_says_503_not_404_while_the_store_is_away(
        store: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(telemetry, "TRACE_WAIT_SECONDS", 0.0)  # found only by waiting for the replica's own writer
    tracer = Tracer(TrackingConfig(tracking_uri=store[0]), Metrics(), redact=False)
    assert tracer.writer is not None
    MADE.append(tracer.writer)

    def answered() -> str:
        with tracer.span("chat.completions", "m/1", {"messages": [{"role": "user", "content": "hi"}]},
                         sampled=True) as span:
            span.finish({"output": "hello"}, {"prompt_tokens": 3, "completion_tokens": 1}, truncated=False)
        return span.request_id

    request_id = answered()
    assert tracer.writer.holds(request_id)  # handed to the writer, not written yet
    assert tracer.feedback({"request_id": request_id, "score": 0.5}) == {"request_id": request_id,
                                                                          "recorded": "score"}
    assert served_request(mlflow.get_trace(request_id)).rated("score") == 0.5
    with pytest.raises(BadRequest) as unknown:
        tracer.feedback({"request_id": new_trace_id(), "score": 0.5})
    assert unknown.value.status == 404 and unknown.value.retry_after is None

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setattr(telemetry, "HELD_WAIT_SECONDS", 1.0)
    tracer.writer = writer(nowhere(), "1")  # the store went away: what the replica holds is known, not lost
    held = answered()
    with pytest.raises(BadRequest) as waiting:
        tracer.feedback({"request_id": held, "label": "good"})
    assert waiting.value.status == 503 and waiting.value.retry_after == 30
    assert "not written yet" in str(waiting.value) and tracer.writer.holds(held)


def test_a_tracer_that_samples_nothing_makes_no_writer(store: tuple[str, str]) -> None:
    tracer = Tracer(TrackingConfig(tracking_uri=store[0]), Metrics(), redact=False, traced=False)
    assert tracer.writer is None and tracer.experiment is not None
    with tracer.span("predict", "m/1", {"rows": []}, sampled=True) as span:
        assert span.record is None and span.request_id.startswith("req-")
