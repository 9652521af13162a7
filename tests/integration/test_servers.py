"""The team setup on loopback: a real Prefect server, a real MLflow server, a deployment run by a worker."""

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import mlflow
import pytest
from mlflow import MlflowClient

from llmops.data.synthetic import instruction_records
from llmops.io.files import write_jsonl
from tests.integration.stack import (
    BIN,
    REPO,
    Processes,
    prefect_server_env,
    start_mlflow,
    start_prefect,
    team_repository,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    root = tmp_path_factory.mktemp("servers")
    processes = Processes(root)
    env = prefect_server_env(root)
    try:
        api, prefect = start_prefect(processes, env)
        url, mlflow_server = start_mlflow(processes, env, f"sqlite:///{root / 'mlflow.db'}",
                                          str(root / "mlflow-artifacts"))
        wait_for(f"{api}/health", prefect)
        wait_for(f"{url}/health", mlflow_server)
        yield {"prefect_api": api, "mlflow": url, "root": str(root)}
    finally:
        processes.stop_all()


def client_env(servers: dict[str, str], home: Path) -> dict[str, str]:
    env = {**os.environ, "PREFECT_API_URL": servers["prefect_api"], "LLMOPS_HOME": str(home),
           "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PREFECT_HOME", None)
    env.pop("MLFLOW_TRACKING_URI", None)
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
    # the server comes from the environment, as a team sets it; its credentials never reach the console
    with_credentials = servers["mlflow"].replace("http://", "http://team:s3cret@")
    result = subprocess.run(
        ["llmops", "run", "configs/tiny_sft_cpu.yaml", f"data.path={instruction_file}", "register.model_name=served"],
        cwd=REPO, env={**client_env(servers, tmp_path / "home"), "MLFLOW_TRACKING_URI": with_credentials},
        capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "version 1 → champion" in result.stdout
    shown = servers["mlflow"].replace("http://", "http://team:***@")
    assert f"MLflow tracking: {shown}" in result.stdout and f"MLflow at {shown}" in result.stdout
    assert "s3cret" not in result.stdout + result.stderr
    assert not (tmp_path / "home" / "mlflow").exists()  # nothing went to the embedded SQLite store
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
    """The worker clones the project (LLMOPS_GIT_REPO at LLMOPS_GIT_BRANCH) and pulls its data with DVC."""
    env = client_env(servers, tmp_path / "home")
    env.pop("PYTHONPATH", None)  # the flow run uses the code of its clone
    origin = team_repository(tmp_path, env, lambda path: write_jsonl(path, instruction_records(rows=50, seed=3)),
                             str(tmp_path / "dvc-remote"))
    env.update(LLMOPS_GIT_REPO=origin.as_uri(), LLMOPS_GIT_BRANCH="main")

    def prefect(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        result = subprocess.run(["prefect", *args], cwd=tmp_path / "seed", env=env, capture_output=True, text=True,
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
