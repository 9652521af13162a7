"""What the service did, in figures: traffic, errors, latency percentiles, tokens, truncation, and the feedback it got
over time; in all and per version."""

from __future__ import annotations

from collections import Counter, defaultdict
from datetime import UTC, datetime
from typing import Any

import numpy as np

from llmops.monitoring.traces import ServedRequest

FEEDBACK = ("score", "label", "correction", "preferred")
PERCENTILES = (50, 95, 99)


def traffic(requests: list[ServedRequest]) -> dict[str, Any]:
    """Requests, errors, latency p50/p95/p99 (ms), tokens and the share of prompts cut."""
    latencies = [request.latency_ms for request in requests if request.latency_ms is not None]
    counted = [request for request in requests if request.endpoint == "chat.completions"]
    return {
        "requests": len(requests),
        "errors": sum(not request.ok for request in requests),
        "latency_ms": {
            f"p{q}": round(float(np.percentile(latencies, q)), 1) if latencies else None for q in PERCENTILES
        },
        "tokens": {
            "prompt": sum(request.prompt_tokens for request in requests),
            "completion": sum(request.completion_tokens for request in requests),
        },
        "truncated_share": round(sum(request.truncated for request in counted) / len(counted), 4) if counted else 0.0,
        "feedback": feedback_counts(requests),
    }


def feedback_counts(requests: list[ServedRequest]) -> dict[str, Any]:
    """How many requests got each kind of feedback, the mean score and the labels given."""
    scores = [score for request in requests if isinstance(score := request.rated("score"), int | float)]
    labels = Counter(str(label) for request in requests if (label := request.rated("label")) is not None)
    counts = {kind: sum(request.rated(kind) is not None for request in requests) for kind in FEEDBACK}
    return {**counts, "mean_score": round(float(np.mean(scores)), 4) if scores else None, "labels": dict(labels)}


def feedback_over_time(requests: list[ServedRequest], bucket_seconds: int) -> dict[str, dict[str, Any]]:
    """Per version, per time bucket (its start, UTC ISO 8601): the feedback of the requests answered then."""
    buckets: dict[str, dict[str, list[ServedRequest]]] = defaultdict(lambda: defaultdict(list))
    for request in requests:
        start = request.at_ms // 1000 // bucket_seconds * bucket_seconds
        buckets[request.version][datetime.fromtimestamp(start, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")].append(request)
    return {
        version: {start: feedback_counts(held) for start, held in sorted(by_time.items())}
        for version, by_time in sorted(buckets.items())
    }


def per_version(requests: list[ServedRequest]) -> dict[str, list[ServedRequest]]:
    versions: dict[str, list[ServedRequest]] = defaultdict(list)
    for request in requests:
        versions[request.version].append(request)
    return dict(sorted(versions.items(), key=lambda item: int(item[0].rpartition("/")[2] or 0)))
