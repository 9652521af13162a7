"""MLflow: the record of every run. Local SQLite store by default, any tracking server if configured."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from numbers import Number
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from tasks import settings
from tasks.config import PipelineConfig, TrackingConfig
from tasks.workspace import home

log = logging.getLogger("llmops.tracking")
# the event that started a run: tags of the run and of the version it registers
TRIGGER_TAGS = ("trigger_event_id", "trigger_event")


class RunHandle(BaseModel):
    """The MLflow run a pipeline run logs into."""

    tracking: TrackingConfig
    run_id: str
    # the Prefect flow run this pipeline run belongs to ("none" outside a flow)
    flow_run_id: str = "none"
    # the event that started it (trigger_event_id, trigger_event), for the registered version's lineage
    trigger: dict[str, str] = {}


def tracking_uri(config: TrackingConfig) -> str:
    return settings.tracking_uri(config)


def client(config: TrackingConfig) -> Any:
    import mlflow
    from mlflow import MlflowClient

    uri, registry = settings.tracking_uri(config), settings.registry_uri(config)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(registry)
    return MlflowClient(tracking_uri=uri, registry_uri=registry)


def experiment_id(config: TrackingConfig) -> str:
    mlflow_client = client(config)
    found = mlflow_client.get_experiment_by_name(config.experiment)
    if found is not None:
        return found.experiment_id
    # the local store keeps its artifacts in the workspace too; a server chooses its own
    location = (home() / "mlflow" / "artifacts").as_uri() if settings.is_local_store(tracking_uri(config)) else None
    return mlflow_client.create_experiment(config.experiment, artifact_location=location)


def start_run(config: PipelineConfig, run_name: str, tags: dict[str, str]) -> str:
    mlflow_client = client(config.tracking)
    run = mlflow_client.create_run(experiment_id(config.tracking), run_name=run_name, tags=tags)
    params = flatten(config.as_dict())
    from mlflow.entities import Param

    for start in range(0, len(params), 100):
        batch = list(params.items())[start:start + 100]
        mlflow_client.log_batch(run.info.run_id, params=[Param(k, str(v)[:6000]) for k, v in batch])
    mlflow_client.log_dict(run.info.run_id, config.as_dict(), "config/resolved.yaml")
    return run.info.run_id


def end_run(config: TrackingConfig, run_id: str, status: str) -> None:
    client(config).set_terminated(run_id, status=status)


@contextmanager
def pipeline_run(config: PipelineConfig, run_name: str, tags: dict[str, str]) -> Iterator[RunHandle]:
    """An MLflow run for the whole pipeline run: FINISHED when the body completes, FAILED if it raises."""
    run = RunHandle(tracking=config.tracking, run_id=start_run(config, run_name, tags),
                    flow_run_id=tags.get("prefect_flow_run_id", "none"),
                    trigger={name: tags[name] for name in TRIGGER_TAGS if tags.get(name)})
    try:
        yield run
    except BaseException as err:
        client(config.tracking).set_tag(run.run_id, "failure", f"{type(err).__name__}: {err}"[:5000])
        end_run(config.tracking, run.run_id, "FAILED")
        raise
    end_run(config.tracking, run.run_id, "FINISHED")


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def numeric(values: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in values.items()
            if isinstance(v, Number) and not isinstance(v, bool) and math.isfinite(float(v))}


def log_metrics(config: TrackingConfig, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
    from mlflow.entities import Metric

    stamp = int(time.time() * 1000)
    batch = [Metric(k, v, stamp, step) for k, v in metrics.items()]
    for start in range(0, len(batch), 500):
        client(config).log_batch(run_id, metrics=batch[start:start + 500])


def set_tags(config: TrackingConfig, run_id: str, tags: dict[str, str]) -> None:
    """All tags in one request, not one per tag."""
    from mlflow.entities import RunTag

    client(config).log_batch(run_id, tags=[RunTag(name, value) for name, value in tags.items()])


def log_stage(config: TrackingConfig, run_id: str, record: Any, seconds: float) -> None:
    """A stage's figures (metrics by code-given names; every figure in a JSON file), whether it computed or
    reused its artifact, and where the artifact is."""
    metrics = {f"{record.stage}.{k}": v for k, v in record.figures.loggable().items()}
    metrics[f"{record.stage}.seconds"] = seconds
    log_metrics(config, run_id, metrics)
    client(config).log_dict(run_id, record.figures.model_dump(mode="json"), f"figures/{record.stage}.json")
    set_tags(config, run_id, {f"stage.{record.stage}": "reused" if record.reused else "computed",
                              f"stage.{record.stage}.key": record.key, f"stage.{record.stage}.path": str(record.dir)})


def log_file(run: RunHandle, path: Path, folder: str) -> None:
    if path.is_file() and path.stat().st_size:
        client(run.tracking).log_artifact(run.run_id, str(path), folder)
