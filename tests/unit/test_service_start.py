"""Starting the service on Ray: a start that fails ends the Ray it started, so the next start (or the next Ray user
in the same process) finds none; Ray's own actors missing their start-up window are tried once on a fresh Ray, and
a second miss is one line."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("ray")
pytest.importorskip("fastapi")

from ray.exceptions import ActorDiedError  # noqa: E402

from llmops.config.schema import TrackingConfig  # noqa: E402
from llmops.io.errors import UserError  # noqa: E402
from llmops.serving import ray_app  # noqa: E402
from llmops.serving.service import ServeSettings  # noqa: E402


class FakeRay:
    """What start_service sees of Ray's state: running or not, and each call in order."""

    def __init__(self, failures: int) -> None:
        self.running = False
        self.failures = failures
        self.calls: list[str] = []

    def init(self, address: str | None) -> None:
        self.running = True
        self.calls.append("init")

    def run(self, *_: Any) -> str:
        self.calls.append("run")
        if self.failures:
            self.failures -= 1
            raise ActorDiedError()
        return "http://127.0.0.1:1"

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


def settings() -> ServeSettings:
    return ServeSettings(reference="model", tracking=TrackingConfig())


@pytest.mark.parametrize("fake", [1], indirect=True)
def test_a_proxy_that_missed_its_start_is_tried_once_more_on_a_fresh_ray(fake: FakeRay) -> None:
    assert ray_app.start_service(settings(), "127.0.0.1", 1) == "http://127.0.0.1:1"
    assert fake.calls == ["init", "run", "stop", "init", "run"] and fake.running


@pytest.mark.parametrize("fake", [2], indirect=True)
def test_a_second_miss_is_one_line_and_leaves_no_ray_running(fake: FakeRay) -> None:
    with pytest.raises(UserError, match=r"^Ray Serve did not start at 127\.0\.0\.1:1: The actor died"):
        ray_app.start_service(settings(), "127.0.0.1", 1)
    assert fake.calls == ["init", "run", "stop", "init", "run", "stop"] and not fake.running


@pytest.mark.parametrize("fake", [0], indirect=True)
def test_any_other_failure_ends_the_ray_it_started_and_is_raised_as_itself(
        fake: FakeRay, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray_app, "run_application", lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        ray_app.start_service(settings(), "127.0.0.1", 1)
    assert fake.calls == ["init", "stop"] and not fake.running


@pytest.mark.parametrize("fake", [1], indirect=True)
def test_a_ray_someone_else_started_is_neither_restarted_nor_ended(fake: FakeRay) -> None:
    fake.running = True
    with pytest.raises(UserError, match="did not start"):
        ray_app.start_service(settings(), "127.0.0.1", 1)
    assert fake.calls == ["run"] and fake.running
