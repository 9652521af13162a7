"""A replica's Prometheus metrics: requests, errors, latency, tokens in and out, queue depth, the version serving, the
traces waiting for the tracking store and those it did not take.

Under a service every replica on a machine writes them to the service's metrics folder
(prometheus_client's multiprocess mode, `PROMETHEUS_MULTIPROC_DIR`, set for the replicas' processes
at their start), so GET /metrics, whichever replica answers it, counts them all: counters summed,
queue depth summed over live replicas, the version serving as the highest over live ones. A replica
that ended (killed, replaced) keeps its counts, as totals should, and its queue is forgotten. A
replica alone (in a test) keeps them in a registry of its own. Replicas on other machines of a
cluster count on their own machine.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# the environment variable naming the folder the replicas of one service on one machine share
METRICS_DIR = "PROMETHEUS_MULTIPROC_DIR"


class Metrics:
    """The replica's Prometheus metrics, shared with the other replicas on its machine under a service (see the
    module's docstring)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.shared = os.environ.get(METRICS_DIR)
        if self.shared:
            os.makedirs(self.shared, exist_ok=True)  # a replica on another node of the cluster
            forget_ended_replicas(self.shared)
        self.registry = CollectorRegistry()
        self.label: str | None = None
        self.requests = Counter("llmops_requests", "Requests answered", ["endpoint", "version"],
                                registry=self.registry)
        self.errors = Counter("llmops_request_errors", "Requests refused or failed", ["endpoint", "status"],
                              registry=self.registry)
        self.latency = Histogram("llmops_request_seconds", "Seconds from arrival to answer", ["endpoint", "version"],
                                 registry=self.registry)
        self.tokens = Counter("llmops_tokens", "Tokens read and written", ["direction", "version"],
                              registry=self.registry)
        self.queue = Gauge("llmops_queue_depth", "Requests running or waiting in the replicas",
                           multiprocess_mode="livesum", registry=self.registry)
        self.version = Gauge("llmops_serving_version", "The version answering new requests (1)", ["version"],
                             multiprocess_mode="livemax", registry=self.registry)
        self.dropped = Counter("llmops_traces_dropped", "Traces the tracking store did not take",
                               registry=self.registry)
        self.traces_held = Gauge("llmops_traces_held", "Traces waiting to be written to the tracking store",
                                 multiprocess_mode="livesum", registry=self.registry)

    def serving(self, label: str) -> None:
        # the old label goes to 0 rather than away: in a shared folder a cleared label would keep its last value
        if self.label not in (None, label):
            self.version.labels(self.label).set(0)
        self.version.labels(label).set(1)
        self.label = label

    def answered(self, endpoint: str, label: str, seconds: float, usage: dict[str, Any]) -> None:
        self.requests.labels(endpoint, label).inc()
        self.latency.labels(endpoint, label).observe(seconds)
        for direction, name in (("in", "prompt_tokens"), ("out", "completion_tokens")):
            if name in usage:
                self.tokens.labels(direction, label).inc(usage[name])

    def failed(self, endpoint: str, status: int) -> None:
        self.errors.labels(endpoint, str(status)).inc()

    def text(self) -> bytes:
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.multiprocess import MultiProcessCollector

        if not self.shared:
            return generate_latest(self.registry)
        every = CollectorRegistry()
        MultiProcessCollector(every, path=self.shared)
        return generate_latest(every)


def forget_ended_replicas(folder: str) -> None:
    """Drop the live gauges of replicas that ended (killed, replaced): their counters stay, as totals should."""
    from prometheus_client import multiprocess

    for path in Path(folder).glob("gauge_live*_*.db"):
        pid = int(path.stem.rsplit("_", 1)[1])
        if not alive(pid):
            multiprocess.mark_process_dead(pid, folder)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True
