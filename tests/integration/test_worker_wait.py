"""A stage sent to the gpu pool never keeps its flow waiting forever: a real Prefect server, real process workers,
the deployments and the automation of `llmops deploy`, and `llmops run` as a user runs it. With
monitor.retrain_on_drift, `llmops deploy` also creates the automation that turns a drift event into a retraining run.

No worker on the pool: after `launch.work_pool_wait` the stage's flow run is cancelled and the run ends in one line.
A worker's machine dies while its run holds the stage (the worker's process group and the run's, which Prefect's
process worker starts in a session of its own, killed): the run's heartbeats stop, the server marks it crashed
and the run ends in one line naming that state; a run that heartbeats and then completes is left alone. Nothing
trains: the test holds the `gpu` limit's only slot, so the sent stage waits for it, running and heartbeating, until
it is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from llmops.data.synthetic import instruction_records
from llmops.flows.deploy import RETRAIN_DEPLOYMENT, RETRAIN_ON_DRIFT
from llmops.flows.events import MODEL_DRIFTED, model_drifted
from llmops.flows.remote import HEARTBEAT_SECONDS, LOST_RUNS, SILENCE_SECONDS
from llmops.io.files import write_jsonl
from tests.integration.stack import CLONE_CLI, PoolStack, Processes, pool_stack, run, signal_group

pytestmark = [pytest.mark.integration, pytest.mark.slow]
WAIT = 5  # launch.work_pool_wait of the run no worker takes


def flow_runs(api: str, flow_name: str) -> list[dict]:
    body = {"flows": {"name": {"any_": [flow_name]}}, "sort": "START_TIME_ASC"}
    return httpx.post(f"{api}/flow_runs/filter", json=body, timeout=10).json()


def seconds_between(start: str, end: str) -> float:
    return (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error:")]


def test_a_stage_no_worker_takes_or_whose_machine_dies_ends_the_run_in_one_line(tmp_path: Path) -> None:
    with pool_stack(tmp_path) as stack:
        api, project = stack.api, stack.project
        data = tmp_path / "instructions.jsonl"
        write_jsonl(data, instruction_records(rows=300, seed=3))
        (project / "drift.yaml").write_text("monitor:\n  retrain_on_drift: true\n")
        deployed = run([*CLONE_CLI, "deploy", "--config", "drift.yaml"], project, stack.sender_env).stdout
        crashes = f"automation {LOST_RUNS}: a remote_stage flow run without a heartbeat for {SILENCE_SECONDS} s"
        assert crashes in deployed, deployed
        assert f"automation {RETRAIN_ON_DRIFT}: a {MODEL_DRIFTED} event starts {RETRAIN_DEPLOYMENT}" in deployed
        a_drift_event_starts_a_retraining_run(api)
        finished, sent_at = a_stage_that_heartbeats_and_completes(api)
        command = [*CLONE_CLI, "run", "configs/tiny_sft_cpu.yaml", f"data.path={data}", "launch.work_pool=gpu",
                   f"workspace.remote={tmp_path / 'store'}"]

        no_worker_cancels_the_stage(api, project, [*command, f"launch.work_pool_wait={WAIT}"], stack.sender_env)
        each_reason_says_what_to_do(api)
        crashed = a_dead_machine_crashes_the_stage(stack, command)
        # the automation took the silent run for dead, and left the one that said it was done alone
        time.sleep(max(0.0, sent_at + SILENCE_SECONDS + 15 - time.monotonic()))
        assert finished not in acted_on(api, crashed)


def a_drift_event_starts_a_retraining_run(api: str) -> None:
    """`llmops monitor`'s drift event, sent to the server: the automation schedules the default deployment's run,
    with the event as its trigger (no cpu worker here, so it waits, scheduled)."""
    import asyncio

    from prefect.events.clients import PrefectEventsClient

    drift = {"requests": 40, "checks": {"scripts": {"p_value": 1e-9, "statistic": 80.0, "drifted": True}}}
    event = model_drifted("served", "served/2", drift)

    async def send() -> None:
        async with PrefectEventsClient(api_url=api) as events:
            await events.emit(event)

    asyncio.run(send())
    deadline = time.monotonic() + 60
    while not (started := [found for found in flow_runs(api, "training_pipeline")
                           if found["parameters"].get("trigger_event") == MODEL_DRIFTED]):
        assert time.monotonic() < deadline, "the drift event started no retraining run"
        time.sleep(1)
    assert started[0]["parameters"]["trigger_event_id"] == str(event.id)


def a_stage_that_heartbeats_and_completes(api: str) -> tuple[str, float]:
    """The events of a remote stage's run that heartbeats, then completes; its id and when they were sent."""
    import asyncio
    import uuid

    from prefect.events import Event
    from prefect.events.clients import PrefectEventsClient

    run_id = f"prefect.flow-run.{uuid.uuid4()}"
    flow = [{"prefect.resource.id": "prefect.flow.1", "prefect.resource.role": "flow",
             "prefect.resource.name": "remote_stage"}]

    async def send() -> None:
        async with PrefectEventsClient(api_url=api) as events:
            for name in ("heartbeat", "Completed"):
                await events.emit(Event(event=f"prefect.flow-run.{name}", resource={"prefect.resource.id": run_id},
                                        related=flow))

    asyncio.run(send())
    return run_id, time.monotonic()


def acted_on(api: str, known: str) -> set[str]:
    """The flow runs the server's automations have acted on (or tried to), once `known` is among them (events are
    stored in batches, after they happen)."""
    body = {"filter": {"event": {"prefix": ["prefect.automation.action."]}}, "limit": 50}
    deadline = time.monotonic() + 60
    while True:
        found = httpx.post(f"{api}/events/filter", json=body, timeout=10).json()["events"]
        runs = {related["prefect.resource.id"] for event in found for related in event["related"]
                if related["prefect.resource.id"].startswith("prefect.flow-run.")}
        if known in runs:
            return runs
        assert time.monotonic() < deadline, f"no automation acted on {known}: {found}"
        time.sleep(2)


def no_worker_cancels_the_stage(api: str, project: Path, command: list[str], env: dict[str, str]) -> None:
    """Nobody polls pool gpu: the stage's flow run is cancelled once the wait is over, the run ends in one line."""
    result = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output
    (child,) = flow_runs(api, "remote_stage")
    assert error_lines(output) == [f"error: train: no worker polled work pool gpu within {WAIT} s, so flow run "
                                   f"{child['name']} is cancelled; start one with: prefect worker start --pool gpu"]
    assert child["state_type"] == "CANCELLED" and child["work_pool_name"] == "gpu"
    waited = seconds_between(child["created"], child["state"]["timestamp"])
    assert WAIT <= waited <= WAIT + 15, waited
    print(f"\nno worker: flow run cancelled {waited:.1f} s after it was sent (wait {WAIT} s)")


def each_reason_says_what_to_do(api: str) -> None:
    """The other ways a stage goes untaken, through the sender's wait itself (3 s): a run a worker took and never
    started, a paused pool, and a worker online that takes nothing (as one at its --limit)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolUpdate
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Pending

    from llmops.flows.remote import NoWorkerError, wait_for_end

    parameters = {"stage": "train", "pool": "gpu", "config": {}, "upstream": [], "run": {}}
    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        def untaken(expected: str) -> None:
            child = run_deployment("remote_stage/gpu", parameters=parameters, timeout=0)
            if "did not start" in expected:
                client.set_flow_run_state(child.id, Pending(), force=True)
            with pytest.raises(NoWorkerError) as raised:
                wait_for_end("train", child, "gpu", 3)
            assert str(raised.value) == f"train: {expected.format(name=child.name)}"
            assert client.read_flow_run(child.id).state.type == "CANCELLED"

        untaken("a worker of work pool gpu took flow run {name} but did not start it within 3 s, so it is "
                "cancelled; that worker's log says why")
        client.update_work_pool("gpu", WorkPoolUpdate(is_paused=True))
        untaken("work pool gpu is paused, so no worker took flow run {name} within 3 s and it is cancelled; "
                "resume it with: prefect work-pool resume gpu")
        client.update_work_pool("gpu", WorkPoolUpdate(is_paused=False))
        client.send_worker_heartbeat("gpu", "busy", heartbeat_interval_seconds=30)
        untaken("1 worker(s) of work pool gpu are online but none took flow run {name} within 3 s (each at its "
                "--limit?), so it is cancelled; start another with: prefect worker start --pool gpu")


def a_dead_machine_crashes_the_stage(stack: PoolStack, command: list[str]) -> str:
    """A worker takes the stage and starts it; its machine dies: the run ends in one line naming the state. Returns
    the crashed run's resource id."""
    api = stack.api
    held = httpx.post(f"{api}/v2/concurrency_limits/increment-with-lease", timeout=10,
                      json={"names": ["gpu"], "slots": 1, "mode": "concurrency", "lease_duration": 3600})
    assert held.status_code == 200, held.text
    worker = stack.start_worker("gpu", PREFECT_WORKER_PREFETCH_SECONDS="5")
    sender = stack.processes.start("sender", command, stack.sender_env, cwd=stack.project)
    child = running_and_heartbeating(api, sender, stack.processes)
    signal_group(worker, signal.SIGKILL)
    os.killpg(int(child["infrastructure_pid"].rpartition(":")[2]), signal.SIGKILL)
    killed = time.monotonic()
    sender.wait(timeout=SILENCE_SECONDS + 120)
    took = time.monotonic() - killed
    output = (stack.root / "sender.log").read_text()
    assert sender.returncode == 2, output
    assert "Traceback" not in output
    assert error_lines(output) == [f"error: train on work pool gpu: flow run {child['name']} ended Crashed: no "
                                   f"heartbeat for {SILENCE_SECONDS} s: the machine or the worker running it is gone"]
    # the last heartbeat came at most HEARTBEAT_SECONDS before the kill
    assert took <= SILENCE_SECONDS + 45, took
    (crashed,) = [r for r in flow_runs(api, "remote_stage") if r["id"] == child["id"]]
    assert crashed["state_type"] == "CRASHED"
    httpx.post(f"{api}/v2/concurrency_limits/decrement-with-lease", json={"lease_id": held.json()["lease_id"]},
               timeout=10)
    print(f"dead machine: the run ended {took:.0f} s after the kill (silence {SILENCE_SECONDS} s, heartbeat every "
          f"{HEARTBEAT_SECONDS} s)")
    return f"prefect.flow-run.{child['id']}"


def running_and_heartbeating(api: str, sender: subprocess.Popen, processes: Processes) -> dict:
    """The sent stage's flow run, once it runs on the worker and the server has its first heartbeat."""
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        assert sender.poll() is None, f"the run ended before its stage ran\n{processes.logs()}"
        running = [r for r in flow_runs(api, "remote_stage") if r["state_type"] == "RUNNING"]
        if running and running[0]["infrastructure_pid"] and heartbeats(api, running[0]["id"]):
            return running[0]
        time.sleep(1)
    raise AssertionError(f"the sent stage did not run within 400 s\n{processes.logs()}")


def heartbeats(api: str, flow_run_id: str) -> int:
    body = {"filter": {"event": {"name": ["prefect.flow-run.heartbeat"]},
                       "resource": {"id": [f"prefect.flow-run.{flow_run_id}"]}}, "limit": 50}
    return len(httpx.post(f"{api}/events/filter", json=body, timeout=10).json()["events"])

