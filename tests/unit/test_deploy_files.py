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
