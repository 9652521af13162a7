"""The team setup on loopback: a real Prefect server, a real MLflow server, a deployment run by a worker."""

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import mlflow
import pytest
from mlflow import MlflowClient

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(url: str, process: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before answering {url}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {seconds}s")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    root = tmp_path_factory.mktemp("servers")
    env = {**os.environ, "PREFECT_HOME": str(root / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    prefect_port, mlflow_port = free_port(), free_port()
    logs = {name: (root / f"{name}.log").open("w") for name in ("prefect", "mlflow")}
    prefect = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port",
                                str(prefect_port)], env=env, stdout=logs["prefect"], stderr=subprocess.STDOUT)
    mlflow = subprocess.Popen([str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(mlflow_port),
                               "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
                               "--artifacts-destination", str(root / "mlflow-artifacts"), "--workers", "1"],
                              env=env, stdout=logs["mlflow"], stderr=subprocess.STDOUT)
    try:
        wait_for(f"http://127.0.0.1:{prefect_port}/api/health", prefect)
        wait_for(f"http://127.0.0.1:{mlflow_port}/health", mlflow)
        yield {"prefect_api": f"http://127.0.0.1:{prefect_port}/api", "mlflow": f"http://127.0.0.1:{mlflow_port}",
               "root": str(root)}
    finally:
        for process in (prefect, mlflow):
            process.terminate()
            process.wait(timeout=30)


def client_env(servers: dict[str, str], home: Path) -> dict[str, str]:
    env = {**os.environ, "PREFECT_API_URL": servers["prefect_api"], "LLMOPS_HOME": str(home),
           "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "LLMOPS_PROJECT_DIR": str(REPO)}
    env.pop("PREFECT_HOME", None)
    return env


def flow_runs(api: str, flow_name: str) -> list[dict]:
    body = {"flows": {"name": {"any_": [flow_name]}}, "sort": "START_TIME_DESC"}
    return httpx.post(f"{api}/flow_runs/filter", json=body, timeout=10).json()


def task_run_names(api: str, flow_run_id: str) -> set[str]:
    body = {"flow_runs": {"id": {"any_": [flow_run_id]}}}
    return {run["name"].rsplit("-", 1)[0] for run in
            httpx.post(f"{api}/task_runs/filter", json=body, timeout=10).json()}


def test_cli_run_against_prefect_and_mlflow_servers(servers: dict[str, str], instruction_file: Path,
                                                     tmp_path: Path) -> None:
    result = subprocess.run(
        ["llmops", "run", "configs/tiny_sft_cpu.yaml", f"data.path={instruction_file}",
         f"tracking.tracking_uri={servers['mlflow']}", "register.model_name=served"],
        cwd=REPO, env=client_env(servers, tmp_path / "home"), capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "version 1 → champion" in result.stdout
    runs = flow_runs(servers["prefect_api"], "training_pipeline")
    assert runs and runs[0]["state_type"] == "COMPLETED"
    assert {"ingest", "validate", "dedup", "tokenize", "train", "evaluate", "register"} <= \
        task_run_names(servers["prefect_api"], runs[0]["id"])
    mlflow_client = MlflowClient(tracking_uri=servers["mlflow"], registry_uri=servers["mlflow"])
    champion = mlflow_client.get_model_version_by_alias("served", "champion")
    assert champion.tags["prefect_flow_run_id"] == runs[0]["id"]
    # the weights went through the server's artifact proxy and come back from it
    mlflow.set_tracking_uri(servers["mlflow"])
    mlflow.set_registry_uri(servers["mlflow"])
    local = mlflow.artifacts.download_artifacts("models:/served@champion", dst_path=str(tmp_path / "dl"))
    assert any(p.name == "model.safetensors" for p in Path(local).rglob("*"))


def test_deployment_run_by_a_process_worker(servers: dict[str, str], instruction_file: Path,
                                            tmp_path: Path) -> None:
    env = client_env(servers, tmp_path / "home")

    def prefect(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        result = subprocess.run(["prefect", *args], cwd=REPO, env=env, capture_output=True, text=True,
                                timeout=timeout)
        assert result.returncode == 0, f"prefect {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
        return result

    prefect("work-pool", "create", "cpu", "--type", "process")
    prefect("--no-prompt", "deploy", "--name", "default")
    params = {"config_path": "configs/tiny_sft_cpu.yaml",
              "overrides": [f"data.path={instruction_file}", f"tracking.tracking_uri={servers['mlflow']}",
                            "register.model_name=deployed"]}
    started = prefect("deployment", "run", "training_pipeline/default", "--params", json.dumps(params))
    run_id = re.search(r"UUID: ([0-9a-f-]{36})", started.stdout).group(1)
    prefect("worker", "start", "--pool", "cpu", "--run-once", timeout=600)
    run = httpx.get(f"{servers['prefect_api']}/flow_runs/{run_id}", timeout=10).json()
    assert run["state_type"] == "COMPLETED", run["state"]
    assert "train" in task_run_names(servers["prefect_api"], run_id)
    mlflow_client = MlflowClient(tracking_uri=servers["mlflow"], registry_uri=servers["mlflow"])
    assert mlflow_client.get_model_version_by_alias("deployed", "champion").version in (1, "1")
