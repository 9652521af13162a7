"""A stage on another machine: the flow sends it to a deployment on a work pool, a worker there runs it.

The sending side (`dispatch`) starts `remote_stage/<pool>` with the config, the upstream records and
the MLflow run, waits for it, takes the stage's record back and makes its artifact local. The worker
side (`remote_stage`) holds a slot of the pool's global concurrency limit (`gpu` caps concurrent GPU
trainings) and calls the stage runner, like the flow itself would. Records are small; artifacts
travel through `workspace.remote`, where the worker also leaves its record for the sender.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from prefect import flow
from prefect.runtime import flow_run

from llmops.core import artifacts, settings, tracking
from llmops.core.config import PipelineConfig
from llmops.core.errors import ConfigError, UserError
from llmops.core.keys import lookup
from llmops.core.stages import STAGES
from llmops.core.stages import stage as table_entry
from llmops.core.store import FsspecStore
from llmops.core.tracking import RunHandle
from llmops.flows.runner import record_type, run_stage

log = logging.getLogger("llmops.remote")
FLOW_NAME = "remote_stage"
POLL_SECONDS = 2


class StageDispatchError(UserError, RuntimeError):
    """A stage sent to a work pool did not come back with its record."""


def work_pool(name: str, config: PipelineConfig) -> str | None:
    """The work pool the config sends stage `name` to, or None when it runs in the flow's process."""
    field = table_entry(name).pool_field
    return lookup(config, field) if field else None


def check_dispatch(config: PipelineConfig, prefect_api: str | None) -> None:
    """Fail before the first stage, not at the one that leaves: sending needs a server and a shared store."""
    placed = [f"{spec.pool_field}={pool}" for spec in STAGES if (pool := work_pool(spec.name, config))]
    if not placed:
        return
    if not config.workspace.remote:
        raise ConfigError(f"{placed[0]} runs a stage on another machine: set workspace.remote, the store its "
                          "artifacts travel through")
    if not prefect_api:
        raise ConfigError(f"{placed[0]} needs a Prefect server with a worker on that pool: set PREFECT_API_URL "
                          "(the embedded ephemeral API has no workers)")


def dispatch(name: str, pool: str, config: PipelineConfig, run: RunHandle, upstream: list[Any]) -> Any:
    """Run stage `name` on a worker of `pool`, wait for it, and return its record with the artifact made local."""
    from prefect.deployments import run_deployment

    deployment = f"{FLOW_NAME}/{pool}"
    log.info("%s: sent to work pool %s (deployment %s)", name, pool, deployment)
    child = run_deployment(deployment, parameters={
        "stage": name, "pool": pool, "config": config.as_dict(), "run": run.model_dump(mode="json"),
        # as JSON text: a figure may be NaN, which plain JSON parameters would turn into null
        "upstream": [record.model_dump_json() for record in upstream]}, poll_interval=POLL_SECONDS,
        timeout=None, as_subflow=True)
    if child.state is None or not child.state.is_completed():
        state = child.state.name if child.state else "unknown"
        message = child.state.message if child.state and child.state.message else "no message"
        raise StageDispatchError(f"{name} on work pool {pool}: flow run {child.name} ended {state}: {message}")
    store = FsspecStore(config.workspace.remote)
    handed = json.loads(store.take_over(str(child.id)))
    record = record_type(name).model_validate(handed["record"])
    with artifacts.sharing(store):
        artifacts.ensure_local(record)
    return record.model_copy(update={"reused": handed["reused"]})


@flow(name=FLOW_NAME, log_prints=True)
def remote_stage(stage: str, pool: str, config: dict[str, Any], upstream: list[str],
                 run: dict[str, Any]) -> dict[str, Any]:
    """Run one pipeline stage here, on a worker of `pool`, for a flow running elsewhere; `upstream` holds the
    records of the stages before it, as JSON."""
    from prefect.concurrency.sync import concurrency

    resolved = PipelineConfig.model_validate(config)
    spec = table_entry(stage)
    records = [record_type(name).model_validate_json(raw) for name, raw in zip(spec.upstream, upstream, strict=True)]
    handle = RunHandle.model_validate(run)
    check_run_is_reachable(handle)
    # strict: a pool without its limit is a setup error (`llmops deploy` creates it), not a reason to overbook
    with concurrency(pool, occupy=1, strict=True):
        record = run_stage(stage, resolved, records, handle)
    handed = json.dumps({"record": json.loads(record.model_dump_json()), "reused": record.reused})
    FsspecStore(resolved.workspace.remote).hand_over(str(flow_run.id), handed)
    return {"stage": stage, "key": record.key, "reused": record.reused}


def check_run_is_reachable(run: RunHandle) -> None:
    """The stage logs into the sender's MLflow run: this worker must see the same tracking store."""
    from mlflow.exceptions import MlflowException

    try:
        tracking.client(run.tracking).get_run(run.run_id)
    except MlflowException:
        uri = settings.mask(settings.tracking_uri(run.tracking))
        raise StageDispatchError(f"this worker's MLflow store ({uri}) has no run {run.run_id}: give every worker "
                                 "the MLFLOW_TRACKING_URI of the flow that sends stages to it") from None
