"""`llmops deploy`: everything prefect.yaml's deployments need on a Prefect server, then the deployments.

The work pools they name (process pools, created when missing), a global concurrency limit named
after each pool that runs stages for other flows (`gpu`: how many trainings at once), the
automation that marks a stage's flow run crashed once its heartbeats stop (its machine or worker
died: the flow that sent it then ends instead of waiting), then `prefect deploy --all`, which
creates the deployments, their schedules and their triggers.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from llmops.flows.api import prefect_api_url
from llmops.flows.events import MODEL_DRIFTED, MODEL_PREFIX
from llmops.flows.remote import FLOW_NAME, LOST_RUNS, SILENCE_SECONDS
from llmops.io.errors import UserError
from llmops.io.files import project_root

POOL_TYPE = "process"
RETRAIN_ON_DRIFT = "llmops-retrain-on-drift"
RETRAIN_DEPLOYMENT = "training_pipeline/default"
REMOTE_STAGE_ENTRYPOINT = f"llmops/flows/remote.py:{FLOW_NAME}"


class DeployError(UserError, RuntimeError):
    """The deployments could not be created; the message says why."""


def deploy_all(prefect_file: str, stage_slots: int, retrain_on_drift: bool = False) -> Iterator[str]:
    """Create the pools and limits prefect.yaml needs, then its deployments, then (with `monitor.retrain_on_drift`)
    the automation that retrains on a drift event; yield a line per thing done."""
    if prefect_api_url() is None:
        raise DeployError("llmops deploy needs a Prefect server: set PREFECT_API_URL (e.g. "
                          "http://127.0.0.1:4200/api); the embedded ephemeral API has no workers to run deployments")
    path = project_root() / prefect_file
    deployments = read_deployments(path)
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        for pool in sorted({d["work_pool"]["name"] for d in deployments if d.get("work_pool")}):
            yield ensure_pool(client, pool)
        remote_pools = sorted({d["work_pool"]["name"] for d in deployments
                               if d.get("entrypoint") == REMOTE_STAGE_ENTRYPOINT})
        for pool in remote_pools:
            client.upsert_global_concurrency_limit_by_name(pool, stage_slots)
            yield f"global concurrency limit {pool}: {stage_slots} at once"
        if remote_pools:
            yield ensure_lost_run_detection(client)
    yield from run_prefect_deploy(path)
    with get_client(sync_client=True) as client:
        yield ensure_drift_retraining(client, retrain_on_drift)


def ensure_drift_retraining(client: Any, enabled: bool) -> str:
    """The automation that starts the default deployment on `llmops.model.drifted`; removed when not enabled."""
    for existing in client.read_automations_by_name(RETRAIN_ON_DRIFT):
        client.delete_automation(existing.id)
    if not enabled:
        return f"automation {RETRAIN_ON_DRIFT}: off (monitor.retrain_on_drift is false): drift events only"
    from prefect.exceptions import ObjectNotFound

    try:
        deployment = client.read_deployment_by_name(RETRAIN_DEPLOYMENT)
    except ObjectNotFound:
        raise DeployError(f"monitor.retrain_on_drift needs the deployment {RETRAIN_DEPLOYMENT} (prefect.yaml's "
                          "`default`); it is not on the server") from None
    client.create_automation(drift_retraining_automation(deployment.id))
    return f"automation {RETRAIN_ON_DRIFT}: a {MODEL_DRIFTED} event starts {RETRAIN_DEPLOYMENT}"


def drift_retraining_automation(deployment_id: Any) -> Any:
    """One retraining per drifted model per hour, whatever the number of monitor runs that see it drift."""
    from datetime import timedelta

    from prefect.events.actions import RunDeployment
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    trigger = EventTrigger(expect={MODEL_DRIFTED}, match={"prefect.resource.id": f"{MODEL_PREFIX}*"},
                           for_each={"prefect.resource.id"}, posture=Posture.Reactive, threshold=1,
                           within=timedelta(hours=1))
    action = RunDeployment(source="selected", deployment_id=deployment_id,
                           parameters={"trigger_event": MODEL_DRIFTED, "trigger_event_id": "{{ event.id | string }}"})
    return AutomationCore(name=RETRAIN_ON_DRIFT, description="Retrain when llmops monitor finds drift.",
                          trigger=trigger, actions=[action])


def read_deployments(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise DeployError(f"{path}: no such file; run llmops deploy in the project folder")
    deployments = (yaml.safe_load(path.read_text()) or {}).get("deployments") or []
    if not deployments:
        raise DeployError(f"{path}: declares no deployments")
    return deployments


def ensure_pool(client: Any, name: str) -> str:
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    try:
        pool = client.read_work_pool(name)
        return f"work pool {name} ({pool.type}) exists"
    except ObjectNotFound:
        client.create_work_pool(WorkPoolCreate(name=name, type=POOL_TYPE,
                                               base_job_template=ProcessWorker.get_default_base_job_template()))
        return f"work pool {name} ({POOL_TYPE}) created"


def ensure_lost_run_detection(client: Any) -> str:
    """The automation that crashes a remote stage's silent flow run, made anew so that it follows this code."""
    for existing in client.read_automations_by_name(LOST_RUNS):
        client.delete_automation(existing.id)
    client.create_automation(lost_runs_automation())
    return f"automation {LOST_RUNS}: a {FLOW_NAME} flow run without a heartbeat for {SILENCE_SECONDS} s is crashed"


def lost_runs_automation() -> Any:
    """Prefect's zombie-run recipe, for the remote stages: after a heartbeat, another one (or the run's end) must
    come within SILENCE_SECONDS, or the run is marked crashed."""
    from datetime import timedelta

    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    heartbeat = "prefect.flow-run.heartbeat"
    ends = {f"prefect.flow-run.{state}" for state in ("Completed", "Failed", "Cancelled", "Crashed")}
    trigger = EventTrigger(match={"prefect.resource.id": "prefect.flow-run.*"},
                           match_related={"prefect.resource.role": "flow", "prefect.resource.name": FLOW_NAME},
                           after={heartbeat}, expect={heartbeat, *ends}, for_each={"prefect.resource.id"},
                           posture=Posture.Proactive, threshold=1, within=timedelta(seconds=SILENCE_SECONDS))
    message = f"no heartbeat for {SILENCE_SECONDS} s: the machine or the worker running it is gone"
    return AutomationCore(name=LOST_RUNS, description=f"Crash {FLOW_NAME} flow runs whose heartbeats stopped.",
                          trigger=trigger, actions=[ChangeFlowRunState(state=StateType.CRASHED, message=message)])


def run_prefect_deploy(path: Path) -> Iterator[str]:
    """Prefect's own deploy: it reads the file, builds the deployments, schedules and triggers."""
    result = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all",
                             "--prefect-file", str(path)], cwd=path.parent, capture_output=True, text=True)
    output = (result.stdout + result.stderr).strip()
    if result.returncode != 0:
        raise DeployError(f"prefect deploy failed: {' '.join(output.splitlines()[-3:]) or 'no output'}")
    for line in output.splitlines():
        if "Deployment '" in line and "successfully created" in line:
            yield line.strip()
