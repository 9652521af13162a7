"""`llmops monitor NAME`: a window of the service's requests, in all and per version, with drift; logged as an MLflow
run of the serving experiment (its figures as metrics, the whole report as `monitor.json`)."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from llmops.config.schema import PipelineConfig
from llmops.monitoring.drift import drift, reference_profile
from llmops.monitoring.export import Exported, export_rows
from llmops.monitoring.figures import feedback_over_time, per_version, traffic
from llmops.monitoring.traces import ServedRequest, served_requests
from llmops.registry.gate import FROZEN_MD5, FROZEN_URI, download_pinned
from llmops.registry.references import model_tags
from llmops.tracking.log import client, experiment_id, log_metrics, serving_tracking

# feedback over time is counted in buckets of this many seconds, unless the window is short
BUCKET_SECONDS = 3600


def window(config: PipelineConfig, name: str, since_seconds: float) -> list[ServedRequest]:
    return served_requests(config.tracking, name, int((time.time() - since_seconds) * 1000))


def monitor(config: PipelineConfig, name: str, since_seconds: float) -> dict[str, Any]:
    """Traffic, errors, latency, tokens, truncation and feedback, in all and per version, and each version's drift
    against its own training data."""
    requests = window(config, name, since_seconds)
    versions = per_version(requests)
    mlflow_client = client(config.tracking)
    bucket = int(min(BUCKET_SECONDS, max(60, since_seconds / 24)))
    return {
        "model": name,
        "since": stamp(time.time() - since_seconds),
        "until": stamp(time.time()),
        **traffic(requests),
        "versions": {
            version: {**traffic(held), "drift": drift(reference_profile(mlflow_client, version), held, config.monitor)}
            for version, held in versions.items()
        },
        "feedback_over_time": feedback_over_time(requests, bucket),
        "bucket_seconds": bucket,
    }


def drifted_versions(report: dict[str, Any]) -> list[str]:
    return [version for version, figures in report["versions"].items() if figures["drift"]["drifted"]]


def log_report(config: PipelineConfig, report: dict[str, Any]) -> str:
    """The report as a run of the serving experiment: its figures as metrics, the whole as monitor.json."""
    serving = serving_tracking(config.tracking)
    mlflow_client = client(serving)
    run = mlflow_client.create_run(
        experiment_id(serving),
        run_name=f"monitor {report['model']}",
        tags={"llmops.monitor": report["model"], "llmops.since": report["since"]},
    )
    log_metrics(serving, run.info.run_id, metrics_of(report))
    mlflow_client.log_dict(run.info.run_id, report, "monitor.json")
    mlflow_client.set_terminated(run.info.run_id)
    return run.info.run_id


def metrics_of(report: dict[str, Any]) -> dict[str, float]:
    """`all.requests`, `v3.latency_p95_ms`, `v3.drift.prompt_length.p_value`...: numbers only."""
    metrics: dict[str, float] = {}
    for scope, figures in [("all", report), *((f"v{v.rpartition('/')[2]}", f) for v, f in report["versions"].items())]:
        metrics[f"{scope}.requests"] = figures["requests"]
        metrics[f"{scope}.errors"] = figures["errors"]
        metrics[f"{scope}.truncated_share"] = figures["truncated_share"]
        metrics.update(
            {f"{scope}.latency_{q}_ms": value for q, value in figures["latency_ms"].items() if value is not None}
        )
        metrics.update({f"{scope}.tokens_{direction}": value for direction, value in figures["tokens"].items()})
        if figures["feedback"]["mean_score"] is not None:
            metrics[f"{scope}.mean_score"] = figures["feedback"]["mean_score"]
        for check, tested in figures.get("drift", {}).get("checks", {}).items():
            metrics[f"{scope}.drift.{check}.p_value"] = tested["p_value"]
        if "drift" in figures:
            metrics[f"{scope}.drifted"] = float(figures["drift"]["drifted"])
    return metrics


def export(config: PipelineConfig, name: str, since_seconds: float, output: Path) -> Exported:
    """Rated requests of the window as rows (monitoring/export.py), guarded by each version's training data and the
    name's frozen evaluation set."""
    requests = window(config, name, since_seconds)
    mlflow_client = client(config.tracking)
    profiles = {version: reference_profile(mlflow_client, version) for version in per_version(requests)}
    return export_rows(requests, profiles, frozen_rows(mlflow_client, name), output)


def frozen_rows(mlflow_client: Any, name: str) -> list[dict[str, Any]]:
    """The rows of the name's pinned frozen evaluation set; none when it has not pinned one yet."""
    import json

    tags = model_tags(mlflow_client, name)
    if FROZEN_URI not in tags:
        return []
    path = download_pinned(tags[FROZEN_URI], tags[FROZEN_MD5])
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def stamp(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
