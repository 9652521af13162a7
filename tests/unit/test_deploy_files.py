"""The deployment files are valid: compose config, Dockerfile sources, prefect.yaml entrypoints."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def compose_command() -> list[str] | None:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def test_compose_file_is_valid() -> None:
    command = compose_command()
    if command is None:
        pytest.skip("neither `docker compose` nor docker-compose is installed")
    result = subprocess.run([*command, "-f", "docker/compose.yaml", "config", "-q"], cwd=REPO, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr


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

    from flows.events import data_updated
    from flows.retrain import retrain_on_data_change
    from tasks.versions import PinnedData

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
    assert gpu["entrypoint"] == "flows/remote.py:remote_stage" and gpu["work_pool"]["name"] == "gpu"
    assert [next(iter(step)) for step in gpu["pull"]] == steps[:2]  # the code only, no dataset


def test_the_trigger_renders_the_event_into_the_flow_parameters() -> None:
    """What the server's run-deployment action does with the trigger's templates, on an event we emit."""
    import copy
    from datetime import UTC, datetime

    from prefect.server.events.actions import RunDeployment
    from prefect.server.events.schemas.events import ReceivedEvent
    from prefect.utilities.schema_tools.hydration import HydrationContext, hydrate

    from flows.events import data_updated
    from tasks.versions import PinnedData

    event = data_updated(PinnedData(dvc_file="data.dvc", path="data", md5="abc.dir"), "push", "c0ffee", False)
    received = ReceivedEvent(**event.model_dump(), received=datetime.now(UTC))
    parameters = copy.deepcopy(deployments()["on-data-change"]["triggers"][0]["parameters"])
    RunDeployment._upgrade_v1_templates(parameters)
    rendered = hydrate(parameters, HydrationContext(raise_on_error=True, render_jinja=True,
                                                    jinja_context={"event": received}))
    assert rendered == {"data_md5": "abc.dir", "trigger_event_id": str(event.id),
                        "trigger_event": "llmops.data.updated"}
