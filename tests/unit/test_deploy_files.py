"""The deployment files are valid: compose config, Dockerfile sources, prefect.yaml entrypoints."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


COMPOSE_FILE = "docker/compose.yaml"
ENV_EXAMPLE = REPO / "docker" / ".env.example"
SECRETS = ("LLMOPS_DB_PASSWORD", "LLMOPS_S3_ROOT_PASSWORD", "LLMOPS_S3_SECRET_KEY", "LLMOPS_PREFECT_AUTH")


def compose_command() -> list[str]:
    """`docker compose` (the CLI plugin) or docker-compose; .ci/run installs the latter where neither is."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise AssertionError("no Compose implementation: install Debian's docker-compose (apt-get install "
                         "docker-compose) or the docker compose plugin; .ci/run does")


def compose(*args: str, env_file: Path) -> subprocess.CompletedProcess[str]:
    # a clean environment: only the env file may supply the stack's settings
    env = {name: value for name, value in os.environ.items() if not name.startswith("LLMOPS_")}
    return subprocess.run([*compose_command(), "-f", COMPOSE_FILE, "--env-file", str(env_file), *args], cwd=REPO,
                          capture_output=True, text=True, env=env)


def env_values(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if re.match(r"[A-Z0-9_]+=", line))


@pytest.fixture
def env_file(tmp_path: Path) -> Path:
    """docker/.env as docker/make-env.sh writes it from the committed example."""
    target = tmp_path / ".env"
    subprocess.run([str(REPO / "docker" / "make-env.sh"), str(target)], check=True, capture_output=True)
    return target


def test_compose_file_is_valid_with_the_generated_env(env_file: Path) -> None:
    result = compose("--profile", "gpu", "config", env_file=env_file)
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    values = env_values(env_file)
    for name in SECRETS:
        assert len(values[name]) >= 40, f"{name} is not a fresh secret"
    assert oct(env_file.stat().st_mode & 0o777) == "0o600"
    command = resolved["services"]["mlflow"]["command"]
    command = " ".join(command) if isinstance(command, list) else command
    assert f"postgresql://llmops:{values['LLMOPS_DB_PASSWORD']}@postgres:5432/mlflow" in command
    assert resolved["services"]["worker-gpu"]["environment"]["AWS_SECRET_ACCESS_KEY"] == values["LLMOPS_S3_SECRET_KEY"]


def test_the_env_example_holds_no_secret_and_compose_stops_without_one() -> None:
    """The example's secrets are empty: used as it is, compose refuses to start and names what to set."""
    values = env_values(ENV_EXAMPLE)
    assert all(values[name] == "" for name in SECRETS)
    result = compose("config", "-q", env_file=ENV_EXAMPLE)
    assert result.returncode != 0
    assert re.search(r"set LLMOPS_\w+ in docker/\.env \(see \.env\.example\)", result.stderr), result.stderr
    compose_text = (REPO / COMPOSE_FILE).read_text()
    for name in values:
        assert name in compose_text, f"{name} in .env.example is not used by {COMPOSE_FILE}"
    for name in set(re.findall(r"\$\{(LLMOPS_\w+)", compose_text)):
        assert name in values, f"{COMPOSE_FILE} reads {name}, which .env.example does not list"


def published(port: str | dict) -> tuple[str, str]:
    """(host address, host port) of a published port, in either implementation's `config` output."""
    if isinstance(port, dict):
        return port.get("host_ip", "0.0.0.0"), str(port["published"])
    parts = port.split("/")[0].split(":")
    return (parts[0], parts[1]) if len(parts) == 3 else ("0.0.0.0", parts[0])


def test_ports_are_published_on_loopback_and_images_pinned(env_file: Path) -> None:
    resolved = yaml.safe_load(compose("--profile", "gpu", "config", env_file=env_file).stdout)
    ports = {name: [published(p) for p in service.get("ports", [])] for name, service in resolved["services"].items()}
    assert ports["mlflow"] == [("127.0.0.1", "5000")] and ports["prefect-server"] == [("127.0.0.1", "4200")]
    assert all(address == "127.0.0.1" for entries in ports.values() for address, _ in entries)
    images = [service["image"] for service in resolved["services"].values()]
    images += re.findall(r"^FROM (\S+)", "".join((REPO / "docker" / f).read_text() for f in ("Dockerfile",
                                                                                               "Dockerfile.gpu")), re.M)
    for image in images:
        if image.startswith("llmops:"):
            continue  # built here from the Dockerfiles
        name, _, tag = image.partition(":")
        assert tag and tag != "latest" and re.search(r"\d", tag), f"{image} is not pinned to a version"


def test_gpu_worker_has_the_gpu_extra_cuda_torch_and_room_for_one_process_per_gpu(env_file: Path) -> None:
    dockerfile = (REPO / "docker" / "Dockerfile.gpu").read_text()
    assert re.search(r'pip install "\.\[[\w,]*\bgpu\b[\w,]*\]"', dockerfile)
    assert re.search(r"torch==[\d.]+\S* --index-url https://download.pytorch.org/whl/cu\d+", dockerfile)
    worker = yaml.safe_load(compose("--profile", "gpu", "config", env_file=env_file).stdout)["services"]["worker-gpu"]
    shm = str(worker["shm_size"])
    assert shm in ("16gb", str(16 * 1024**3))  # the implementations print it differently
    device = worker["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["count"] in ("all", -1) and device["capabilities"] == ["gpu"]
    assert worker["entrypoint"] == ["/opt/llmops/docker/worker-start.sh"]


def test_dockerignore_keeps_local_state_data_and_secrets_out_of_the_images(tmp_path: Path) -> None:
    """The build context as Docker filters it (docker-py's .dockerignore rules): every tracked file but the data,
    and none of the workspace, environments, stores, caches or credentials."""
    from docker.utils.build import exclude_paths

    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    local = [".git/HEAD", ".venv/bin/python", ".llmops/mlflow/mlflow.db", ".llmops/artifacts/train/k/model.bin",
             "mlruns/0/meta.yaml", "mlartifacts/1/model.pkl", "data/instructions.jsonl", ".dvc/cache/files/md5/ab/c",
             ".dvc/tmp/lock", ".dvc/config.local", "docker/.env", ".env", "tasks/__pycache__/x.cpython-311.pyc",
             "llmops.egg-info/PKG-INFO", ".pytest_cache/v/cache", "sub/.venv/bin/python", "notes/mlflow.db"]
    needed = ["docker/.env.example", "docker/worker-start.sh", "data.dvc", ".dvc/config", "dvc.yaml", "configs/x.yaml"]
    for relative in tracked + local + needed:
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text("")
    patterns = [line for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    kept = set(exclude_paths(str(tmp_path), patterns))
    assert not kept & set(local), f"baked into the image: {sorted(kept & set(local))}"
    assert {f for f in tracked if not f.startswith("data/")} <= kept, sorted(set(tracked) - kept)
    assert set(needed) <= kept


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.gpu"])
def test_dockerfiles_copy_what_exists(dockerfile: str) -> None:
    text = (REPO / "docker" / dockerfile).read_text()
    for sources in re.findall(r"^COPY (.+) \S+$", text, flags=re.M):
        for source in sources.split():
            assert source == "." or (REPO / source).exists(), f"{dockerfile} copies missing {source}"
    pyproject = (REPO / "pyproject.toml").read_text()
    for extras in re.findall(r'pip install "\.\[([\w,]+)\]"', text):
        for extra in extras.split(","):
            assert re.search(rf"^{extra} = \[", pyproject, flags=re.M), f"extra {extra} is not declared"


def test_prefect_deployments_point_at_flows() -> None:
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    import importlib

    for deployment in spec["deployments"]:
        path, name = deployment["entrypoint"].split(":")
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        flow = getattr(module, name)
        assert set(deployment["parameters"]) <= set(flow.parameters.properties)
        assert deployment["work_pool"]["name"] in ("cpu", "gpu")


def deployments() -> dict[str, dict]:
    return {d["name"]: d for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]}


def test_a_stored_data_version_triggers_retraining_once_per_md5() -> None:
    from prefect.events.schemas.deployment_triggers import DeploymentTriggerTypes
    from pydantic import TypeAdapter

    from llmops.data.versions import PinnedData
    from llmops.flows.events import data_updated
    from llmops.flows.retrain import retrain_on_data_change

    spec = deployments()["on-data-change"]
    (trigger,) = [TypeAdapter(DeploymentTriggerTypes).validate_python(t) for t in spec["triggers"]]
    assert trigger.expect == {"llmops.data.updated"} and trigger.posture == "Reactive" and trigger.threshold == 1
    assert trigger.within.total_seconds() >= 30 and "llmops.dataset.md5" in trigger.for_each
    assert set(trigger.parameters) <= set(retrain_on_data_change.parameters.properties)
    assert trigger.parameters["data_md5"] == "{{ event.payload.md5 }}"
    version = PinnedData(dvc_file="data.dvc", path="data", md5="abc.dir")
    assert trigger.match.matches(data_updated(version, "push", "c0ffee", False).resource)
    # pinned but not on the DVC remote yet: no worker could pull it
    assert not trigger.match.matches(data_updated(version, "add", "c0ffee", False).resource)
    assert spec["concurrency_limit"] == 1


def test_deployments_run_from_a_fresh_clone_with_the_pinned_data() -> None:
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    steps = [next(iter(step)) for step in spec["pull"]]
    assert steps == ["prefect.deployments.steps.git_clone", "prefect.deployments.steps.set_working_directory",
                     "prefect.deployments.steps.run_shell_script"]
    clone = spec["pull"][0]["prefect.deployments.steps.git_clone"]
    assert (clone["repository"], clone["branch"]) == ("{{ $LLMOPS_GIT_REPO }}", "{{ $LLMOPS_GIT_BRANCH }}")
    assert spec["pull"][2]["prefect.deployments.steps.run_shell_script"]["script"] == "dvc pull"
    gpu = deployments()["gpu"]
    assert gpu["entrypoint"] == "llmops/flows/remote.py:remote_stage" and gpu["work_pool"]["name"] == "gpu"
    assert [next(iter(step)) for step in gpu["pull"]] == steps[:2]  # the code only, no dataset


def test_the_trigger_renders_the_event_into_the_flow_parameters() -> None:
    """What the server's run-deployment action does with the trigger's templates, on an event we emit."""
    import copy
    from datetime import UTC, datetime

    from prefect.server.events.actions import RunDeployment
    from prefect.server.events.schemas.events import ReceivedEvent
    from prefect.utilities.schema_tools.hydration import HydrationContext, hydrate

    from llmops.data.versions import PinnedData
    from llmops.flows.events import data_updated

    event = data_updated(PinnedData(dvc_file="data.dvc", path="data", md5="abc.dir"), "push", "c0ffee", False)
    received = ReceivedEvent(**event.model_dump(), received=datetime.now(UTC))
    parameters = copy.deepcopy(deployments()["on-data-change"]["triggers"][0]["parameters"])
    RunDeployment._upgrade_v1_templates(parameters)
    rendered = hydrate(parameters, HydrationContext(raise_on_error=True, render_jinja=True,
                                                    jinja_context={"event": received}))
    assert rendered == {"data_md5": "abc.dir", "trigger_event_id": str(event.id),
                        "trigger_event": "llmops.data.updated"}
