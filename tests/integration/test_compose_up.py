"""The compose stack as shipped, brought up by Docker where a Docker engine runs (skipped elsewhere, saying why).

`docker compose up --build` with an env file written by docker/make-env.sh: the MLflow server answers and keeps
a run in its Postgres store and an artifact in the object store; the Prefect server answers, refuses a client
without its login, and the cpu worker (through the image's entry point) reaches it and makes its pool.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.compose import COMPOSE_FILE, make_env, read_env_file

REPO = Path(__file__).resolve().parents[2]
PUBLISHED = (4200, 5000, 9000, 9001)  # compose publishes the stack on these ports of 127.0.0.1
STARTUP_SECONDS = 600


def docker_missing() -> str | None:
    """Why compose cannot bring the stack up here; None when it can."""
    if not shutil.which("docker"):
        return "no docker CLI on this machine: the stack is tested without Docker (test_team_stack.py)"
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        return "`docker info` fails: no Docker engine to bring the stack up (test_team_stack.py tests it without)"
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0:
        return "a Docker engine but no `docker compose` plugin"
    return None


MISSING = docker_missing()
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.skipif(MISSING is not None, reason=str(MISSING))]


def taken(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def wait_until_up(url: str, logs) -> None:
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise AssertionError(f"{url} did not answer within {STARTUP_SECONDS}s\n{logs()}")


@pytest.mark.timeout(3600)  # the first build installs PyTorch into the image
def test_compose_brings_the_stack_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    busy = [port for port in PUBLISHED if taken(port)]
    if busy:
        pytest.skip(f"127.0.0.1 ports {busy} are taken: compose publishes the stack there")
    env_file = tmp_path / ".env"
    make_env(env_file)
    settings = read_env_file(env_file)
    compose = ["docker", "compose", "-p", f"llmops-smoke-{os.getpid()}", "-f", str(COMPOSE_FILE), "--env-file",
               str(env_file)]
    env = {name: value for name, value in os.environ.items() if not name.startswith("LLMOPS_")}

    def logs() -> str:
        return subprocess.run([*compose, "logs", "--tail", "40"], cwd=REPO, env=env, capture_output=True,
                              text=True).stdout

    try:
        up = subprocess.run([*compose, "up", "-d", "--build"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=3000)
        assert up.returncode == 0, up.stderr[-4000:]
        wait_until_up("http://127.0.0.1:5000/health", logs)
        wait_until_up("http://127.0.0.1:4200/api/health", logs)

        prefect = httpx.Client(base_url="http://127.0.0.1:4200/api/", timeout=10,
                               auth=tuple(settings["LLMOPS_PREFECT_AUTH"].split(":", 1)))
        assert httpx.post("http://127.0.0.1:4200/api/flows/filter", json={}, timeout=10).status_code == 401
        deadline = time.monotonic() + STARTUP_SECONDS
        while "cpu" not in {pool["name"] for pool in prefect.post("work_pools/filter", json={}).json()}:
            assert time.monotonic() < deadline, f"the cpu worker never reached the Prefect server\n{logs()}"
            time.sleep(2)

        import boto3
        from mlflow import MlflowClient

        monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
        client = MlflowClient("http://127.0.0.1:5000")
        run = client.create_run(client.create_experiment(f"smoke-{uuid.uuid4().hex[:8]}"))
        client.log_text(run.info.run_id, "kept in the object store", "smoke.txt")
        assert [artifact.path for artifact in client.list_artifacts(run.info.run_id)] == ["smoke.txt"]
        store = boto3.client("s3", endpoint_url="http://127.0.0.1:9000", region_name="us-east-1",
                             aws_access_key_id=settings["LLMOPS_S3_ACCESS_KEY"],
                             aws_secret_access_key=settings["LLMOPS_S3_SECRET_KEY"])
        keys = [o["Key"] for o in store.list_objects_v2(Bucket="mlflow-artifacts").get("Contents", [])]
        assert any(key.endswith(f"{run.info.run_id}/artifacts/smoke.txt") for key in keys), keys
    finally:
        subprocess.run([*compose, "down", "-v", "--remove-orphans"], cwd=REPO, env=env, capture_output=True)
