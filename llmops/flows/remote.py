"""A stage on another machine: the flow sends it to a deployment on a work pool, a worker there runs it.

The sending side (`dispatch`) starts `remote_stage/<pool>` with the config, the upstream records and
the MLflow run, waits for it, takes the stage's record back and makes its artifact local. The worker
side (`remote_stage`) holds a slot of the pool's global concurrency limit (`gpu` caps concurrent GPU
trainings) and calls the stage runner, like the flow itself would. Records are small; artifacts
travel through `workspace.remote`, where the worker also leaves its record for the sender.

The wait never hangs. A worker has the stage's wait field (`launch.work_pool_wait`) to take the run,
and as long again to start it; past either, the run is cancelled and the flow ends in one line. A
running stage has no limit (training takes hours), but its flow run heartbeats every
HEARTBEAT_SECONDS, and the server's LOST_RUNS automation (`llmops deploy` creates it) marks a run
silent for SILENCE_SECONDS as crashed: a dead machine or worker ends the wait with that state.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prefect import flow
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.objects import FlowRun, State, StateType, WorkerStatus
from prefect.runtime import flow_run

from llmops.config.schema import PipelineConfig
from llmops.io.errors import ConfigError, Transient, UserError, worth_retrying
from llmops.pipeline.keys import lookup
from llmops.pipeline.runner import record_type, run_stage
from llmops.pipeline.stages import STAGES
from llmops.pipeline.stages import stage as table_entry
from llmops.store import artifacts, settings
from llmops.store.shared import FsspecStore
from llmops.tracking import log as tracking
from llmops.tracking.log import RunHandle

log = logging.getLogger("llmops.remote")
FLOW_NAME = "remote_stage"
POLL_SECONDS = 2
# how often a remote stage's flow run heartbeats (prefect.yaml sets PREFECT_FLOWS_HEARTBEAT_FREQUENCY for its
# deployments; 30 is Prefect's least), and how long a silent one runs before the server marks it crashed
HEARTBEAT_SECONDS = 30
SILENCE_SECONDS = 4 * HEARTBEAT_SECONDS
# the server's automation that does it (`llmops deploy` creates it)
LOST_RUNS = "llmops-crash-silent-remote-stages"


class StageDispatchError(UserError, RuntimeError):
    """A stage sent to a work pool did not come back with its record."""


class NoWorkerError(StageDispatchError):
    """No worker took the stage's flow run, or started it, within the wait; the run is cancelled. Not Transient: the
    stage is not sent again, since the next try would wait as long for the same absent worker."""


class RemoteStageRefused(StageDispatchError):
    """The stage's flow run failed on its worker on the user's config or data, or on the worker's own setup: it left
    its one-line reason in the store. Not Transient: sent again, it would fail the same way."""


class RemoteStageFailed(Transient, StageDispatchError):
    """The stage's flow run ended on its worker without completing (failed, crashed, its machine gone): the stage's
    retries send it again."""


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
    if config.launch.work_pool and config.train.nodes > 1 and config.engine.name == "local":
        # the sent stage would wait at the rendezvous for machines nothing starts
        raise ConfigError(f"launch.work_pool={config.launch.work_pool} with train.nodes={config.train.nodes} starts "
                          "one machine's launcher: set engine.name=ray (Ray Train starts a worker on every node of "
                          "the cluster), or start the launcher on each machine yourself (torchrun, Slurm, Kubernetes) "
                          "without launch.work_pool")


def dispatch(name: str, pool: str, config: PipelineConfig, run: RunHandle, upstream: list[Any]) -> Any:
    """Run stage `name` on a worker of `pool`, wait for it, and return its record with the artifact made local."""
    from prefect.deployments import run_deployment

    deployment = f"{FLOW_NAME}/{pool}"
    wait = pickup_wait(name, config)
    log.info("%s: sent to work pool %s (deployment %s); a worker has %d s to take it", name, pool, deployment, wait)
    child = run_deployment(deployment, parameters={
        "stage": name, "pool": pool, "config": config.as_dict(), "run": run.model_dump(mode="json"),
        # as JSON text: a figure may be NaN, which plain JSON parameters would turn into null
        "upstream": [record.model_dump_json() for record in upstream]}, timeout=0, as_subflow=True)
    state = wait_for_end(name, child, pool, wait)
    store = FsspecStore(config.workspace.remote)
    if not state.is_completed():
        raise failure(f"{name} on work pool {pool}: flow run {child.name}", state, store, str(child.id))
    handed = json.loads(store.take_over(str(child.id)))
    record = record_type(name).model_validate(handed["record"])
    with artifacts.sharing(store):
        artifacts.ensure_local(record)
    return record.model_copy(update={"reused": handed["reused"]})


def failure(where: str, state: State, store: FsspecStore, run_id: str) -> StageDispatchError:
    """Why a stage's flow run did not complete: the reason its worker refused the stage for, when it left one (the
    stage is not sent again), else the run's final state (its retries send it again)."""
    try:
        refused = json.loads(store.take_over(run_id)).get("refused")
    except FileNotFoundError:
        refused = None
    if refused:
        return RemoteStageRefused(f"{where} failed on its worker: {refused}")
    return RemoteStageFailed(f"{where} ended {state.name}: {state.message or 'no message'}")


@contextmanager
def refusal_handed_over(store: FsspecStore, run_id: str) -> Iterator[None]:
    """A stage that fails here on a user error (config, data, this worker's setup) leaves its one-line reason for
    the sender, which ends the run with it instead of sending the stage again to fail the same way."""
    try:
        yield
    except BaseException as err:
        if not worth_retrying(err):
            store.hand_over(run_id, json.dumps({"refused": str(err)}))
        raise


def pickup_wait(name: str, config: PipelineConfig) -> int:
    """Seconds a worker has to take stage `name`'s flow run, and then as many to start it."""
    field = table_entry(name).pool_wait_field
    if field is None:
        raise ValueError(f"stage {name} names a work pool field but no pool_wait_field")
    return lookup(config, field)


def wait_for_end(name: str, child: FlowRun, pool: str, wait: int) -> State:
    """The child flow run's final state. Scheduled (no worker took it) and pending (taken, not started yet) may
    each last `wait` seconds; running has no limit here: the run ends itself, or the server crashes it once its
    heartbeats stop."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        warn_without_lost_run_detection(client)
        seen, since = None, time.monotonic()
        while True:
            state = client.read_flow_run(child.id).state
            if state is not None and state.is_final():
                return state
            state_type = state.type if state is not None else None
            if state_type != seen:
                seen, since = state_type, time.monotonic()
            elif state_type in (StateType.SCHEDULED, StateType.PENDING) and time.monotonic() - since > wait:
                raise give_up(client, name, child, pool, wait, state_type)
            time.sleep(POLL_SECONDS)


def give_up(client: SyncPrefectClient, name: str, child: FlowRun, pool: str, wait: int,
            state_type: StateType) -> NoWorkerError:
    """Cancel the child run no worker took (or started) in time, and say why in one line."""
    from prefect.states import Cancelled

    if state_type == StateType.PENDING:
        reason = (f"a worker of work pool {pool} took flow run {child.name} but did not start it within {wait} s, "
                  "so it is cancelled; that worker's log says why")
    elif client.read_work_pool(pool).is_paused:
        reason = (f"work pool {pool} is paused, so no worker took flow run {child.name} within {wait} s and it is "
                  f"cancelled; resume it with: prefect work-pool resume {pool}")
    elif online := [w for w in client.read_workers_for_work_pool(pool) if w.status == WorkerStatus.ONLINE]:
        reason = (f"{len(online)} worker(s) of work pool {pool} are online but none took flow run {child.name} "
                  f"within {wait} s (each at its --limit?), so it is cancelled; start another with: "
                  f"prefect worker start --pool {pool}")
    else:
        reason = (f"no worker polled work pool {pool} within {wait} s, so flow run {child.name} is cancelled; "
                  f"start one with: prefect worker start --pool {pool}")
    client.set_flow_run_state(child.id, Cancelled(message=reason), force=True)
    return NoWorkerError(f"{name}: {reason}")


def warn_without_lost_run_detection(client: SyncPrefectClient) -> None:
    """Without the server's automation, a run whose worker died would keep this flow waiting: say so up front."""
    if not any(automation.enabled for automation in client.read_automations_by_name(LOST_RUNS)):
        log.warning("the Prefect server has no automation %s: if the machine running this stage dies, this flow "
                    "waits for it forever; create it with: llmops deploy", LOST_RUNS)


@flow(name=FLOW_NAME, log_prints=True)
def remote_stage(stage: str, pool: str, config: dict[str, Any], upstream: list[str],
                 run: dict[str, Any]) -> dict[str, Any]:
    """Run one pipeline stage here, on a worker of `pool`, for a flow running elsewhere; `upstream` holds the
    records of the stages before it, as JSON."""
    from prefect.concurrency.sync import concurrency

    resolved = PipelineConfig.model_validate(config)
    store = FsspecStore(resolved.workspace.remote)
    with refusal_handed_over(store, str(flow_run.id)):
        check_heartbeat()
        spec = table_entry(stage)
        records = [record_type(name).model_validate_json(raw)
                   for name, raw in zip(spec.upstream, upstream, strict=True)]
        handle = RunHandle.model_validate(run)
        check_run_is_reachable(handle)
        # strict: a pool without its limit is a setup error (`llmops deploy` creates it), not a reason to overbook
        with concurrency(pool, occupy=1, strict=True):
            record = run_stage(stage, resolved, records, handle)
    handed = json.dumps({"record": json.loads(record.model_dump_json()), "reused": record.reused})
    store.hand_over(str(flow_run.id), handed)
    return {"stage": stage, "key": record.key, "reused": record.reused}


def check_heartbeat() -> None:
    """The server marks a remote stage silent for SILENCE_SECONDS as crashed: this run must heartbeat often enough
    not to be taken for dead, and at all, or the flow that sent it could not tell that it died."""
    from prefect.settings import get_current_settings

    every = get_current_settings().flows.heartbeat_frequency
    if every is None or every > HEARTBEAT_SECONDS:
        raise StageDispatchError(f"this worker's flow runs heartbeat {f'every {every} s' if every else 'never'}: set "
                                 f"PREFECT_FLOWS_HEARTBEAT_FREQUENCY={HEARTBEAT_SECONDS} for the {FLOW_NAME} "
                                 "deployments (prefect.yaml does), or a long stage is taken for dead")


def check_run_is_reachable(run: RunHandle) -> None:
    """The stage logs into the sender's MLflow run: this worker must see the same tracking store."""
    from mlflow.exceptions import MlflowException

    try:
        tracking.client(run.tracking).get_run(run.run_id)
    except MlflowException:
        uri = settings.mask(settings.tracking_uri(run.tracking))
        raise StageDispatchError(f"this worker's MLflow store ({uri}) has no run {run.run_id}: give every worker "
                                 "the MLFLOW_TRACKING_URI of the flow that sends stages to it") from None
