"""The service when things break: the registry goes away while it follows an alias (it keeps serving what it has and
says so once), a replica is killed under load (only what it held fails, and the service is whole again within 30 s),
the tracking store goes away while requests are traced (their traces are kept and written when it is back; what
overflows is counted), and Ctrl-C on `llmops serve` (the service and Ray's processes end within seconds)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import mlflow
import psutil
import pytest

from llmops.config.schema import TrackingConfig
from llmops.serving import trace_export
from llmops.serving.follow import Follower, smoke
from llmops.serving.metrics import Metrics
from llmops.serving.telemetry import Tracer
from tests.helpers import metric_total, register_random_language_model
from tests.integration.stack import free_port
from tests.reliability.servers import BIN, LoopbackProxy, start_mlflow

pytestmark = [pytest.mark.reliability, pytest.mark.slow, pytest.mark.integration]
NAME = "faulty"
# whole again: a killed replica is replaced, and answers, within this
RECOVERY_SECONDS = 30


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LoopbackProxy, TrackingConfig]]:
    """An MLflow server behind a proxy that can cut it off, holding NAME/1 (a tiny random language model)."""
    root = tmp_path_factory.mktemp("registry")
    process, port = start_mlflow(root)
    proxy = LoopbackProxy(port)
    config = TrackingConfig(tracking_uri=proxy.url)
    try:
        register_random_language_model(NAME, config, root)
        yield proxy, config
    finally:
        proxy.cut()
        process.terminate()
        process.wait(timeout=30)


def test_the_registry_down_while_following_keeps_the_version_and_says_so_once(
        registry: tuple[LoopbackProxy, TrackingConfig], monkeypatch: pytest.MonkeyPatch) -> None:
    proxy, config = registry
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    follower = Follower(NAME, config)
    assert follower.live.label == f"{NAME}/1" and follower.poll() is None
    proxy.cut()
    try:
        said = [follower.poll() for _ in range(3)]
        smoke(follower.live.loaded)  # still answers
    finally:
        proxy.restore()
    assert said[0].startswith("the registry does not answer (") and said[0].endswith(
        f"serving {NAME}/1 until it does") and said[1:] == [None, None]
    assert follower.poll() == f"the registry answers again; {NAME}@champion is {NAME}/1"
    assert follower.live.label == f"{NAME}/1"


def traced(tracer: Tracer, count: int) -> list[str]:
    """`count` requests' traces, as the replica writes them: the ids of the requests."""
    ids = []
    for number in range(count):
        with tracer.span("chat.completions", f"{NAME}/1", {"messages": [{"role": "user", "content": f"row {number}"}]},
                         sampled=True) as span:
            span.finish({"output": "four"}, {"prompt_tokens": 3, "completion_tokens": 1}, truncated=False)
        ids.append(span.request_id)
    return ids


def stored(tracer: Tracer) -> set[str]:
    found = mlflow.search_traces(locations=[tracer.experiment], max_results=1000, return_type="list")
    return {trace.info.trace_id for trace in found}


def test_traces_are_kept_while_the_tracking_store_is_down_and_written_when_it_is_back(
        registry: tuple[LoopbackProxy, TrackingConfig], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    proxy, config = registry
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    metrics = Metrics()
    tracer = Tracer(config, metrics, redact=False)
    before = stored(tracer)
    proxy.cut()
    try:
        began = time.monotonic()
        kept = traced(tracer, 30)
        took = time.monotonic() - began  # one store call alone would take its 5 s timeout
        deadline = time.monotonic() + 30
        while not (tracer.writer.down and metrics.traces_held._value.get() == 30) and time.monotonic() < deadline:
            time.sleep(0.2)
        held = metrics.traces_held._value.get()  # all 30, while the store is away
        monkeypatch.setattr(trace_export, "CAPACITY", 40)  # a smaller buffer: 40 kept, the 10 oldest dropped
        overflowing = traced(tracer, 20)
    finally:
        proxy.restore()
    tracer.close()
    assert took < 2, took
    assert tracer.writer.down is False and held == 30
    assert metrics.dropped._value.get() == 10 and metrics.traces_held._value.get() == 0
    written = stored(tracer) - before
    assert written == set(kept[10:] + overflowing)
    said = [record.getMessage() for record in caplog.records if record.name == "llmops.serve"]
    assert sum(line.startswith("the tracking store does not answer (") for line in said) == 1, said
    assert sum(line.startswith("the tracking store answers again") for line in said) == 1, said


def ask_until(url: str, done: threading.Event, clients: int) -> list[tuple[float, int]]:
    """`clients` threads asking chat completions until `done`: (when answered, status) of each request."""
    answered: list[tuple[float, int]] = []

    def client() -> None:
        with httpx.Client(timeout=60) as http:
            while not done.is_set():
                try:
                    status = http.post(f"{url}/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "row 3 says"}], "max_tokens": 4}).status_code
                except httpx.HTTPError:
                    status = 0
                answered.append((time.monotonic(), status))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answered


def replica_pids() -> list[int]:
    """The replicas' processes: Ray's workers under this test's Ray, titled after the actor they hold."""
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            if "ServeReplica" in " ".join(process.cmdline()) and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process.pid)
        except psutil.Error:  # ended while looked at
            continue
    return found


def test_a_replica_killed_under_load_fails_only_what_it_held_and_is_replaced(
        registry: tuple[LoopbackProxy, TrackingConfig], alone: Callable[[], AbstractContextManager[None]]) -> None:
    from llmops.serving.ray_app import start_service, stop_service
    from llmops.serving.service import ServeSettings

    _, config = registry
    clients = 4
    settings = ServeSettings(reference=NAME, tracking=config, follow_seconds=5, queue=8, timeout_seconds=30)
    url = start_service(settings, "127.0.0.1", free_port(), replicas=2)
    try:
        assert len(replica_pids()) == 2
        load: list[list[tuple[float, int]]] = []
        done = threading.Event()
        asking = threading.Thread(target=lambda: load.append(ask_until(url, done, clients)))
        asking.start()
        time.sleep(5)
        try:
            # the 30 s are a replica's start on this machine, not on one shared with two other tests
            with alone():
                victim = replica_pids()[0]
                os.kill(victim, signal.SIGKILL)
                killed = time.monotonic()
                while len([pid for pid in replica_pids() if pid != victim]) < 2:
                    assert time.monotonic() - killed < RECOVERY_SECONDS, "the killed replica was not replaced in time"
                    time.sleep(1)
                whole = time.monotonic()
                time.sleep(5)  # and then answers on both
        finally:
            done.set()
            asking.join()
        counted = {metric_total(httpx.get(f"{url}/metrics", timeout=30).text, "llmops_requests_total{")
                   for _ in range(6)}
    finally:
        stop_service()
    statuses = [status for _, status in load[0]]
    failed = [status for status in statuses if status != 200]
    assert statuses.count(200) > 20 and len(failed) <= clients, failed  # at most the requests it held
    assert all(status == 200 for at, status in load[0] if at > whole + 1)
    # whichever replica answers GET /metrics counts every replica's requests, the killed one's too
    assert len(counted) == 1 and abs(counted.pop() - statuses.count(200)) <= clients, (counted, statuses.count(200))


def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def test_ctrl_c_stops_the_service_and_rays_processes_within_seconds(
        registry: tuple[LoopbackProxy, TrackingConfig], tmp_path: Path) -> None:
    _, config = registry
    port = free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": str(config.tracking_uri), "LLMOPS_HOME": str(tmp_path / "home")}
    log = (tmp_path / "serve.log").open("w")
    service = subprocess.Popen([str(BIN / "llmops"), "serve", NAME, "--port", str(port)], stdout=log,
                               stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        # as a user does: once it says it serves (and answers)
        while "Ctrl-C stops it" not in (tmp_path / "serve.log").read_text() or not healthy(
                f"http://127.0.0.1:{port}/health"):
            assert service.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(1)
        started: list[Any] = descendants(service.pid)
        assert started, "Ray's processes are the service's children"
        service.send_signal(signal.SIGINT)
        stopped = time.monotonic()
        assert service.wait(timeout=60) == 0, (tmp_path / "serve.log").read_text()
        _, alive = psutil.wait_procs(started, timeout=15)
        took = time.monotonic() - stopped
    finally:
        if service.poll() is None:
            os.killpg(service.pid, signal.SIGKILL)
    assert not alive, [process.info for process in alive]
    assert took < 45, took
    assert "stopping the service" in (tmp_path / "serve.log").read_text()


def healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
