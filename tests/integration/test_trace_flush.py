"""The traces of answered requests outlive the replica (slow: a process of its own, as a replica is): MLflow exports
them in the background, and what is still queued when Ray Serve stops the replica is exported before it ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REQUESTS = 60
REPLICA = f"""
import json
import os
import mlflow
from llmops.config.schema import TrackingConfig
from llmops.serving.metrics import Metrics
from llmops.serving.telemetry import Tracer
from llmops.store.settings import resolved_stores

metrics = Metrics()
tracer = Tracer(resolved_stores(TrackingConfig()), metrics, redact=False)
ids = []
for number in range({REQUESTS}):
    with tracer.span("chat.completions", "m/1", {{"messages": [{{"role": "user", "content": f"row {{number}}"}}]}},
                     sampled=True) as span:
        span.finish({{"output": "four"}}, {{"prompt_tokens": 3, "completion_tokens": 1}}, truncated=False)
    ids.append(span.request_id)
tracer.close()  # what the replica does when Ray Serve stops it
print(json.dumps({{"ids": ids, "dropped": metrics.dropped._value.get(), "experiment": tracer.experiment,
                  "store": mlflow.get_tracking_uri()}}), flush=True)
os._exit(0)  # as a Ray worker ends: no exit handlers, so only the replica's own flush exports the queue
"""


def test_the_traces_still_queued_when_a_replica_stops_reach_the_store(tmp_path: Path) -> None:
    import mlflow

    env = {**os.environ, "LLMOPS_HOME": str(tmp_path / "home")}
    done = subprocess.run([sys.executable, "-c", REPLICA], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["dropped"] == 0 and all(request_id.startswith("tr-") for request_id in figures["ids"])
    assert figures["store"].startswith("sqlite:") and str(tmp_path) in figures["store"]
    mlflow.set_tracking_uri(figures["store"])
    stored = mlflow.search_traces(locations=[figures["experiment"]], max_results=1000, return_type="list")
    assert sorted(trace.info.trace_id for trace in stored) == sorted(figures["ids"])
