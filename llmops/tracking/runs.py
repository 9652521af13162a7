"""MLflow runs: one per pipeline run, opened, closed (FINISHED, KILLED or FAILED), linked when a training resumes.

A run left RUNNING by a process that is gone is marked KILLED by the next run on the same machine;
a run that resumes another's training links to it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from llmops.config.schema import PipelineConfig, TrackingConfig
from llmops.io.errors import Interrupted
from llmops.store.settings import mask
from llmops.tracking.log import (
    DESCRIPTION_TAG,
    PARAM_LIMIT,
    RUN_TAG_LIMIT,
    TRIGGER_TAGS,
    RunHandle,
    TrackingUnavailableError,
    check_reachable,
    client,
    clip,
    config_params,
    experiment_id,
    log_metrics,
    metric_name,
    public_config,
    set_tags,
    split_credentials,
    tracking_uri,
    unreachable,
)

log = logging.getLogger("llmops.tracking")


def start_run(config: PipelineConfig, run_name: str, tags: dict[str, str]) -> str:
    check_reachable(config.tracking)
    mlflow_client = client(config.tracking)
    experiment = experiment_id(config.tracking)
    owner = {"llmops.host": socket.gethostname(), "llmops.pid": str(os.getpid())}
    run = mlflow_client.create_run(experiment, run_name=run_name,
                                   tags={**{name: clip(mask(value), RUN_TAG_LIMIT) for name, value in tags.items()},
                                         **owner})
    close_orphaned_runs(config.tracking, experiment, run.info.run_id)
    params = config_params(config)
    from mlflow.entities import Param

    for start in range(0, len(params), 100):
        batch = list(params.items())[start:start + 100]
        # a long value (a chat template, many sources) is clipped: the whole config is config/resolved.yaml
        mlflow_client.log_batch(run.info.run_id, params=[Param(k, clip(v, PARAM_LIMIT)) for k, v in batch])
    mlflow_client.log_dict(run.info.run_id, public_config(config), "config/resolved.yaml")
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
    started = time.monotonic()
    try:
        yield run
    except BaseException as err:
        lost = unreachable(err, config.tracking)
        if lost is None:
            log_duration(config.tracking, run.run_id, started)
            stopped = isinstance(err, KeyboardInterrupt | Interrupted)
            record_failure(config.tracking, run.run_id, err, "KILLED" if stopped else "FAILED")
            raise
        # the server is what failed: marking the run would only wait out the retries again
        bare = split_credentials(tracking_uri(config.tracking))[0]
        raise TrackingUnavailableError(f"MLflow tracking server {mask(bare)} stopped answering during the "
                                       f"run ({lost}) and did not come back within the retries; the run "
                                       f"stopped, MLflow run {run.run_id} stays unfinished") from None
    log_duration(config.tracking, run.run_id, started)
    end_run(config.tracking, run.run_id, "FINISHED")


def log_duration(config: TrackingConfig, run_id: str, started: float) -> None:
    """The run's wall time as `run/seconds`, however it ended; a tracking problem here must not hide the run's own
    error."""
    try:
        log_metrics(config, run_id, {metric_name("run", "seconds"): round(time.monotonic() - started, 3)})
    except Exception as problem:
        log.warning("could not log the duration of MLflow run %s: %s", run_id, mask(str(problem))[:300])


def record_failure(config: TrackingConfig, run_id: str, err: BaseException, status: str = "FAILED") -> None:
    """Mark the run FAILED (KILLED when it was stopped) with its error, masked; a tracking problem here must not
    hide the error itself."""
    try:
        failure = mask(f"{type(err).__name__}: {err}")[:5000]
        set_tags(config, run_id, {"failure": failure, DESCRIPTION_TAG: f"{status.lower()}: {failure}"})
        end_run(config, run_id, status)
    except Exception as problem:  # the server may be failing too: the run's own error matters more
        log.warning("could not mark MLflow run %s as failed: %s", run_id, mask(str(problem))[:300])


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
        closing_sample(monitor)


def closing_sample(monitor: Any) -> None:
    """One more sample as training ends: MLflow logs none until a whole interval has passed, so a training shorter
    than one would have no system figures at all."""
    try:
        monitor.collect_metrics()
        monitor.publish_metrics(monitor.aggregate_metrics())
        monitor.mlflow_logger.flush()
    except Exception as err:  # the figures are a courtesy: the training stands without them
        log.debug("no closing system metrics sample: %s", err)
