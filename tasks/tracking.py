"""MLflow: the record of every run. Local SQLite store by default, any tracking server if configured."""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from numbers import Number
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from tasks import settings
from tasks.config import PipelineConfig, TrackingConfig
from tasks.workspace import Interrupted

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
    return mlflow_client.create_experiment(config.experiment, artifact_location=artifact_location(config))


def artifact_location(config: TrackingConfig) -> str | None:
    """Where a new experiment keeps its artifacts: the configured place; for a local store, beside it (MLflow's
    own default is ./mlruns in whatever folder the command runs in); for a server, the server's choice."""
    if config.artifact_location:
        return config.artifact_location
    uri = tracking_uri(config)
    if not settings.is_local_store(uri):
        return None
    if uri.startswith("sqlite:///"):
        return (Path(uri.removeprefix("sqlite:///")).resolve().parent / "artifacts").as_uri()
    return (Path(uri.removeprefix("file://").removeprefix("file:")).resolve() / "artifacts").as_uri()


def start_run(config: PipelineConfig, run_name: str, tags: dict[str, str]) -> str:
    mlflow_client = client(config.tracking)
    experiment = experiment_id(config.tracking)
    owner = {"llmops.host": socket.gethostname(), "llmops.pid": str(os.getpid())}
    run = mlflow_client.create_run(experiment, run_name=run_name, tags={**tags, **owner})
    close_orphaned_runs(config.tracking, experiment, run.info.run_id)
    params = flatten(config.as_dict())
    from mlflow.entities import Param

    for start in range(0, len(params), 100):
        batch = list(params.items())[start:start + 100]
        mlflow_client.log_batch(run.info.run_id, params=[Param(k, str(v)[:6000]) for k, v in batch])
    mlflow_client.log_dict(run.info.run_id, config.as_dict(), "config/resolved.yaml")
    return run.info.run_id


def end_run(config: TrackingConfig, run_id: str, status: str) -> None:
    client(config).set_terminated(run_id, status=status)


def close_orphaned_runs(config: TrackingConfig, experiment: str, current: str) -> None:
    """Runs left RUNNING by a process of this machine that no longer exists (killed, powered off) are KILLED,
    with a tag saying which run found them."""
    mlflow_client = client(config)
    host = socket.gethostname()
    for run in mlflow_client.search_runs([experiment], "attributes.status = 'RUNNING'", max_results=200):
        tags = run.data.tags
        if run.info.run_id == current or tags.get("llmops.host") != host or alive(tags.get("llmops.pid", "")):
            continue
        mlflow_client.set_tag(run.info.run_id, "llmops.closed_by", current)
        mlflow_client.set_terminated(run.info.run_id, status="KILLED")
        log.info("run %s was left running by a process that is gone: marked KILLED", run.info.run_id)


def alive(pid: str) -> bool:
    if not pid.isdigit():
        return True  # not ours to judge
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def pipeline_run(config: PipelineConfig, run_name: str, tags: dict[str, str]) -> Iterator[RunHandle]:
    """An MLflow run for the whole pipeline run: FINISHED when the body completes, KILLED when it was stopped on
    a signal, FAILED if it raised."""
    run = RunHandle(tracking=config.tracking, run_id=start_run(config, run_name, tags),
                    flow_run_id=tags.get("prefect_flow_run_id", "none"),
                    trigger={name: tags[name] for name in TRIGGER_TAGS if tags.get(name)})
    try:
        yield run
    except BaseException as err:
        stopped = isinstance(err, KeyboardInterrupt | Interrupted)
        client(config.tracking).set_tag(run.run_id, "failure", f"{type(err).__name__}: {err}"[:5000])
        end_run(config.tracking, run.run_id, "KILLED" if stopped else "FAILED")
        raise
    end_run(config.tracking, run.run_id, "FINISHED")


def link_resumed_run(runs_file: Path, run: RunHandle | None) -> None:
    """A training folder remembers the runs that worked on it: a run that resumes another's training links to it,
    and the other, if still marked running, is closed as KILLED."""
    if run is None:
        return
    earlier = json.loads(runs_file.read_text()) if runs_file.is_file() else []
    if earlier and earlier[-1] != run.run_id:
        previous = earlier[-1]
        mlflow_client = client(run.tracking)
        set_tags(run.tracking, run.run_id, {"llmops.resumes": previous})
        try:
            mlflow_client.set_tag(previous, "llmops.resumed_by", run.run_id)
            if mlflow_client.get_run(previous).info.status == "RUNNING":
                mlflow_client.set_terminated(previous, status="KILLED")
        except Exception as err:  # a run in another store (the workspace moved): the link from this side stays
            log.info("could not update the resumed run %s: %s", previous, err)
    if run.run_id not in earlier:
        runs_file.write_text(json.dumps([*earlier, run.run_id]))


@contextmanager
def system_metrics(run: RunHandle | None, enabled: bool) -> Iterator[None]:
    """MLflow's system metrics (CPU, memory, GPU utilisation and memory) on the run while training."""
    if run is None or not enabled:
        yield
        return
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    client(run.tracking)
    monitor = SystemMetricsMonitor(run.run_id, sampling_interval=5, samples_before_logging=1)
    monitor.start()
    try:
        yield
    finally:
        monitor.finish()


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


def recent_runs(config: TrackingConfig, limit: int) -> list[dict[str, Any]]:
    """The newest runs, with the links a resume or a clean-up left between them."""
    from datetime import datetime

    mlflow_client = client(config)
    experiment = mlflow_client.get_experiment_by_name(config.experiment)
    if experiment is None:
        return []
    found = mlflow_client.search_runs([experiment.experiment_id], order_by=["attributes.start_time DESC"],
                                      max_results=limit)
    short = {run.info.run_id: run.info.run_id[:8] for run in found}
    rows = []
    for run in found:
        tags, info = run.data.tags, run.info
        ended = info.end_time or int(time.time() * 1000)
        rows.append({"run": short[info.run_id], "name": info.run_name, "status": info.status,
                     "started": datetime.fromtimestamp(info.start_time / 1000).strftime("%Y-%m-%d %H:%M:%S"),
                     "minutes": round((ended - info.start_time) / 60000, 1),
                     **{link: short.get(tags.get(f"llmops.{link}", ""), tags.get(f"llmops.{link}", "")[:8])
                        for link in ("resumes", "resumed_by", "closed_by")}})
    return rows


def log_table(run: RunHandle, rows: list[dict[str, Any]], artifact_file: str) -> None:
    """Rows as a table the tracking UI shows (a JSON artifact of columns); nothing for no rows."""
    if not rows:
        return
    columns = {name: [row.get(name) for row in rows] for name in rows[0]}
    client(run.tracking).log_table(run.run_id, columns, artifact_file)
