"""How long the service's next batch gathers: only the least wait when the model is idle; while a batch runs, what it
has left and a short linger after it, never less than the least wait."""

from __future__ import annotations

import pytest

from llmops.serving.service import Pacing


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
