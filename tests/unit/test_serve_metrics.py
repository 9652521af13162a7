"""The replicas of a service share their metrics: any one's /metrics counts them all, and forgets the queue of one
that ended while keeping what it answered."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import metric_total

REPLICA = """
import os, sys
from llmops.serving.metrics import Metrics
metrics = Metrics()
metrics.serving(sys.argv[1])
for _ in range(int(sys.argv[2])):
    metrics.answered("chat", sys.argv[1], 0.05, {"prompt_tokens": 7, "completion_tokens": 3})
metrics.queue.set(int(sys.argv[3]))
sys.stdout.write(metrics.text().decode())
"""


def replica(folder: Path, label: str, answered: int, queue: int) -> str:
    """A replica's process: it answers, holds a queue, and prints what its /metrics would say."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(folder)}
    return subprocess.run([sys.executable, "-c", REPLICA, label, str(answered), str(queue)], env=env, check=True,
                          capture_output=True, text=True).stdout


def test_any_replica_counts_every_replica_and_forgets_only_the_queue_of_one_that_ended(tmp_path: Path) -> None:
    replica(tmp_path, "m/1", answered=5, queue=3)  # a replica that has ended: its process is gone
    second = replica(tmp_path, "m/2", answered=2, queue=1)
    assert metric_total(second, 'llmops_requests_total{endpoint="chat",version="m/1"}') == 5
    assert metric_total(second, 'llmops_requests_total{endpoint="chat",version="m/2"}') == 2
    assert metric_total(second, 'llmops_tokens_total{direction="in"') == 7 * 7
    assert metric_total(second, "llmops_request_seconds_count") == 7
    assert metric_total(second, "llmops_queue_depth") == 1  # the ended replica's 3 are not waiting anywhere
    assert metric_total(second, 'llmops_serving_version{version="m/2"}') == 1


def test_a_replica_alone_keeps_its_metrics_to_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    from llmops.serving.metrics import Metrics

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    metrics = Metrics()
    metrics.serving("m/1")
    metrics.serving("m/2")
    metrics.answered("chat", "m/2", 0.1, {})
    text = metrics.text().decode()
    assert metric_total(text, 'llmops_serving_version{version="m/1"}') == 0
    assert metric_total(text, 'llmops_serving_version{version="m/2"}') == 1
    assert metric_total(text, "llmops_requests_total") == 1
