"""The deployment files are valid: compose config, Dockerfile sources, prefect.yaml entrypoints.

The compose file is checked without Docker (tests/compose.py): Compose's JSON schema and its variable
interpolation; where a Compose implementation is installed, a test checks that it reads the file the same way.
"""

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.compose import TEAM_REPO, ComposeError, compose_variables, make_env, resolve

REPO = Path(__file__).resolve().parents[2]


COMPOSE_FILE = "docker/compose.yaml"
ENV_EXAMPLE = REPO / "docker" / ".env.example"
SECRETS = ("LLMOPS_DB_PASSWORD", "LLMOPS_S3_ROOT_PASSWORD", "LLMOPS_S3_SECRET_KEY", "LLMOPS_PREFECT_AUTH")


def clean_environment() -> dict[str, str]:
    """The environment less the stack's own settings: only the env file may supply them."""
    return {name: value for name, value in os.environ.items() if not name.startswith("LLMOPS_")}


def resolved(env_file: Path, *profiles: str) -> dict:
    """The compose file as `docker compose --env-file ENV_FILE --profile ... config` reads it."""
    return resolve(compose_variables(env_file, clean_environment()), profiles)


def env_values(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if re.match(r"[A-Z0-9_]+=", line))


@pytest.fixture
def env_file(tmp_path: Path) -> Path:
    """docker/.env as docker/make-env.sh writes it from the committed example."""
    target = tmp_path / ".env"
    make_env(target)
    return target


def test_compose_file_is_valid_with_the_generated_env(env_file: Path) -> None:
    stack = resolved(env_file, "gpu")  # schema-valid, every variable set
    values = env_values(env_file)
    for name in SECRETS:
        assert len(values[name]) >= 40, f"{name} is not a fresh secret"
    assert oct(env_file.stat().st_mode & 0o777) == "0o600"
    command = shlex.split(stack["services"]["mlflow"]["command"])
    assert command[command.index("--backend-store-uri") + 1] == (
        f"postgresql://llmops:{values['LLMOPS_DB_PASSWORD']}@postgres:5432/mlflow")
    assert stack["services"]["worker-gpu"]["environment"]["AWS_SECRET_ACCESS_KEY"] == values["LLMOPS_S3_SECRET_KEY"]
    for worker in ("worker-cpu", "worker-gpu"):  # what prefect.yaml's pull steps clone
        environment = stack["services"][worker]["environment"]
        assert (environment["LLMOPS_GIT_REPO"], environment["LLMOPS_GIT_BRANCH"]) == (TEAM_REPO, "main")


def test_make_env_takes_the_repository_from_origin_or_says_to_set_it(tmp_path: Path) -> None:
    """The workers clone LLMOPS_GIT_REPO: make-env fills it from the checkout's origin remote; without one it leaves
    it empty (compose then stops and names it) and says so."""
    checkout = tmp_path / "checkout"
    (checkout / "docker").mkdir(parents=True)
    for name in ("make-env.sh", ".env.example"):
        shutil.copy2(REPO / "docker" / name, checkout / "docker" / name)
    env = {name: value for name, value in clean_environment().items() if not name.startswith("GIT_")}
    env["GIT_CEILING_DIRECTORIES"] = str(tmp_path.parent)  # no repository above the test's folder counts
    bare = subprocess.run([str(checkout / "docker" / "make-env.sh"), str(tmp_path / "bare.env")], env=env,
                          capture_output=True, text=True, check=True)
    assert env_values(tmp_path / "bare.env")["LLMOPS_GIT_REPO"] == ""
    assert "no origin remote: set LLMOPS_GIT_REPO in" in bare.stderr
    with pytest.raises(ComposeError, match="required variable LLMOPS_GIT_REPO is missing a value: set "
                                           "LLMOPS_GIT_REPO in docker/.env"):
        resolve(compose_variables(tmp_path / "bare.env", clean_environment()))
    subprocess.run(["git", "init", "-q", str(checkout)], env=env, check=True)
    subprocess.run(["git", "-C", str(checkout), "remote", "add", "origin", "git@git.example.com:team/llmops.git"],
                   env=env, check=True)
    subprocess.run([str(checkout / "docker" / "make-env.sh"), str(tmp_path / "origin.env")], env=env, check=True,
                   capture_output=True)
    assert env_values(tmp_path / "origin.env")["LLMOPS_GIT_REPO"] == "git@git.example.com:team/llmops.git"


def test_the_env_example_holds_no_secret_and_compose_stops_without_one() -> None:
    """The example's secrets are empty: used as it is, compose refuses to start and names what to set."""
    values = env_values(ENV_EXAMPLE)
    assert all(values[name] == "" for name in SECRETS)
    with pytest.raises(ComposeError, match=r"required variable LLMOPS_\w+ is missing a value: set LLMOPS_\w+ in "
                                           r"docker/\.env \(see \.env\.example\)"):
        resolved(ENV_EXAMPLE)
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
    stack = resolved(env_file, "gpu")
    ports = {name: [published(p) for p in service.get("ports", [])] for name, service in stack["services"].items()}
    assert ports["mlflow"] == [("127.0.0.1", "5000")] and ports["prefect-server"] == [("127.0.0.1", "4200")]
    assert all(address == "127.0.0.1" for entries in ports.values() for address, _ in entries)
    images = [service["image"] for service in stack["services"].values()]
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
    # dev too: the GPU tests run in the image
    assert re.search(r'pip install "\.\[[\w,]*\bdev\b[\w,]*\]"', dockerfile)
    assert re.search(r"torch==[\d.]+\S* --index-url https://download.pytorch.org/whl/cu\d+", dockerfile)
    worker = resolved(env_file, "gpu")["services"]["worker-gpu"]
    shm = str(worker["shm_size"])
    assert shm in ("16gb", str(16 * 1024**3))  # the implementations print it differently
    device = worker["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["count"] in ("all", -1) and device["capabilities"] == ["gpu"]
    assert worker["entrypoint"] == ["/opt/llmops/docker/worker-start.sh"]


def compose_binary() -> list[str] | None:
    """`docker compose` (the CLI plugin) or docker-compose, where one is installed."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def what_services_run(stack: dict) -> dict[str, dict]:
    """Per service, what it runs and where it listens, in one form whichever implementation printed it."""
    def words(command: str | list | None) -> list[str] | None:
        return shlex.split(command) if isinstance(command, str) else command

    return {name: {"image": service.get("image"), "command": words(service.get("command")),
                   "environment": service.get("environment"),
                   "ports": [published(port) for port in service.get("ports", [])]}
            for name, service in stack["services"].items()}


@pytest.mark.skipif(compose_binary() is None, reason="neither `docker compose` nor docker-compose is installed: "
                                                     "the schema and tests/compose.py's interpolation are the check")
def test_an_installed_compose_reads_the_file_as_the_tests_do(env_file: Path) -> None:
    def compose(*args: str, env: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*compose_binary(), "-f", COMPOSE_FILE, "--env-file", str(env), *args], cwd=REPO,
                              capture_output=True, text=True, env=clean_environment())

    result = compose("--profile", "gpu", "config", env=env_file)
    assert result.returncode == 0, result.stderr
    assert what_services_run(yaml.safe_load(result.stdout)) == what_services_run(resolved(env_file, "gpu"))
    refused = compose("config", "-q", env=ENV_EXAMPLE)
    assert refused.returncode != 0
    assert re.search(r"set LLMOPS_\w+ in docker/\.env \(see \.env\.example\)", refused.stderr), refused.stderr


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


def test_the_mlflow_image_installs_the_driver_of_its_backend_uri(env_file: Path) -> None:
    """The driver the installed SQLAlchemy picks for compose's backend URI is importable, comes from the team extra,
    and the mlflow service's image installs that extra."""
    import tomllib
    from importlib.metadata import packages_distributions

    from packaging.requirements import Requirement
    from sqlalchemy.engine import make_url

    service = resolved(env_file)["services"]["mlflow"]
    command = shlex.split(service["command"])
    dialect = make_url(command[command.index("--backend-store-uri") + 1]).get_dialect()
    module = dialect.import_dbapi().__name__.split(".")[0]  # raises when the driver is not installed
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    team = {Requirement(line).name for line in project["optional-dependencies"]["team"]}
    assert set(packages_distributions()[module]) & team, f"{dialect.driver} ({module}) is not in the team extra"
    build = service["build"]  # the context is relative to the compose file, the dockerfile to the context
    dockerfile = (REPO / Path(COMPOSE_FILE).parent / build["context"] / build["dockerfile"]).read_text()
    assert "team" in ",".join(re.findall(r'pip install "\.\[([\w,]+)\]"', dockerfile)).split(",")


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


def test_a_remote_stage_that_stops_heartbeating_is_crashed_by_the_server() -> None:
    """The gpu deployment's runs heartbeat often enough for the automation `llmops deploy` creates: it crashes a
    remote_stage run only after several heartbeats are missing, and only runs of that flow."""
    from llmops.flows.deploy import lost_runs_automation
    from llmops.flows.remote import FLOW_NAME, HEARTBEAT_SECONDS, LOST_RUNS, SILENCE_SECONDS

    env = deployments()["gpu"]["work_pool"]["job_variables"]["env"]
    assert env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == str(HEARTBEAT_SECONDS)
    assert SILENCE_SECONDS >= 3 * HEARTBEAT_SECONDS
    automation = lost_runs_automation()
    trigger = automation.trigger
    assert automation.name == LOST_RUNS and trigger.posture == "Proactive" and trigger.threshold == 1
    assert trigger.within.total_seconds() == SILENCE_SECONDS and trigger.after == {"prefect.flow-run.heartbeat"}
    assert {"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
            "prefect.flow-run.Crashed", "prefect.flow-run.Cancelled"} == trigger.expect
    assert trigger.for_each == {"prefect.resource.id"}
    from prefect.events.schemas.events import RelatedResource

    def flow(name: str) -> RelatedResource:
        return RelatedResource({"prefect.resource.id": "prefect.flow.1", "prefect.resource.role": "flow",
                                "prefect.resource.name": name})

    assert trigger.match_related.matches(flow(FLOW_NAME))
    assert not trigger.match_related.matches(flow("training_pipeline"))
    (action,) = automation.actions
    assert action.type == "change-flow-run-state" and action.state == "CRASHED"
    assert f"no heartbeat for {SILENCE_SECONDS} s" in action.message
