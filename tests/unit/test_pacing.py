"""How long the service's next batch gathers: only the least wait when the model is idle; while a batch runs, what it
has left and a short linger after it, never less than the least wait. And when a replica refuses: past the wait a
request can expect, from the batches it measured, once two batches are full, and past its queue."""

from __future__ import annotations

import pytest

from llmops.config.schema import TrackingConfig
from llmops.serving.service import Pacing, ServeSettings, refusal


def test_an_idle_model_closes_the_next_batch_after_the_least_wait() -> None:
    pacing = Pacing(least=0.01)
    assert pacing.wait(now=5.0) == 0.01
    pacing.begin(now=5.0)
    pacing.end(now=5.04)
    assert pacing.wait(now=6.0) == 0.01  # a batch ran before, none runs now: a lone client waits for nothing


def test_while_a_batch_runs_the_next_gathers_for_what_it_has_left_and_lingers_after_it() -> None:
    pacing = Pacing(least=0.01)
    pacing.begin(now=0.0)
    pacing.end(now=0.04)  # the last batch took 40 ms
    pacing.begin(now=1.0)
    assert pacing.wait(now=1.01) == pytest.approx(0.03 + 0.02)  # 30 ms left, then half of 40 ms
    assert pacing.wait(now=1.2) == 0.01  # overdue: the least wait, never less


def test_the_linger_after_a_long_batch_is_at_most_fifty_milliseconds() -> None:
    pacing = Pacing(least=0.01)
    pacing.begin(now=0.0)
    pacing.end(now=4.0)  # a long generation: the lock was free, the requests are already read
    pacing.begin(now=10.0)
    assert pacing.wait(now=11.0) == pytest.approx(3.0 + 0.05)


def test_the_expected_wait_counts_the_batches_ahead_and_its_own_at_the_typical_duration() -> None:
    pacing = Pacing(least=0.01)
    assert pacing.expected_wait(pending=100, max_batch=16) == 0.0  # nothing measured yet: no reason to refuse
    pacing.begin(now=0.0)
    pacing.end(now=0.1)
    assert pacing.typical_seconds == pytest.approx(0.1)
    pacing.begin(now=1.0)
    pacing.end(now=1.6)  # one slow batch moves the average a fifth of the way
    assert pacing.typical_seconds == pytest.approx(0.2)
    assert pacing.expected_wait(pending=0, max_batch=16) == pytest.approx(0.2)
    assert pacing.expected_wait(pending=16, max_batch=16) == pytest.approx(0.4)  # a full batch ahead of it
    assert pacing.expected_wait(pending=47, max_batch=16) == pytest.approx(0.6)


def refusal_at(pending: int, batch_seconds: float, **limits: float) -> float | None:
    """The admission rule for a replica holding `pending` requests whose batches took `batch_seconds`."""
    settings = ServeSettings(reference="m", tracking=TrackingConfig(), **limits)  # type: ignore[arg-type]
    pacing = Pacing(least=0.01)
    pacing.begin(now=0.0)
    pacing.end(now=batch_seconds)
    return refusal(pending, pacing, settings)


def test_past_the_wait_budget_a_request_is_refused_with_the_seconds_to_come_back() -> None:
    fast = {"max_batch": 16, "max_wait_seconds": 0.5, "queue": 256}
    assert refusal_at(pending=40, batch_seconds=0.1, **fast) is None
    assert refusal_at(pending=79, batch_seconds=0.1, **fast) is None  # 5 batches of 0.1 s: 0.5 s
    assert refusal_at(pending=80, batch_seconds=0.1, **fast) == 1.0
    # 4 batches of 1 s ahead: come back when most of them are answered
    assert refusal_at(pending=63, batch_seconds=1.0, **fast) == pytest.approx(3.5)


def test_two_full_batches_are_always_taken_however_slow_a_batch_and_never_more_than_the_queue() -> None:
    slow = {"max_batch": 8, "max_wait_seconds": 0.5}
    assert refusal_at(pending=15, batch_seconds=30.0, **slow) is None  # the running batch and the next
    assert refusal_at(pending=16, batch_seconds=30.0, **slow) is not None
    assert refusal_at(pending=4, batch_seconds=0.01, queue=4, max_batch=16) == 1.0
