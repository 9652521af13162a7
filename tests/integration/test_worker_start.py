"""The worker containers' entry point: the pinned data comes from the DVC remote on S3 (a local moto server),
into the project as the images hold it (the build context after .dockerignore: no .git, no data, no cache)."""

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

from tests.integration.compose_stack import image_copy

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # dvc of this environment, as the image has it on PATH
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
               "DVC_NO_ANALYTICS": "1"}


@pytest.fixture
def s3() -> Iterator[str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="test", aws_secret_access_key="test",
                 region_name="us-east-1").create_bucket(Bucket="dvc-remote")
    yield endpoint
    server.stop()


def pinned_and_pushed(team: Path, endpoint: str) -> None:
    """A teammate's checkout: data pinned with DVC and pushed to the S3 remote."""
    from dvc.repo import Repo

    (team / "data").mkdir(parents=True)
    (team / "data" / "rows.jsonl").write_text('{"text": "pinned version"}\n')
    subprocess.run(["git", "init", "-q"], cwd=team, check=True)
    repo = Repo.init(str(team))
    with repo.config.edit() as config:
        config["remote"]["store"] = {"url": "s3://dvc-remote/llmops", "endpointurl": endpoint}
        config["core"]["remote"] = "store"
    repo.add(str(team / "data"))
    repo.push()
    repo.close()


def test_worker_start_pulls_the_pinned_data_then_runs_the_worker(s3: str, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    team, image, volume = tmp_path / "checkout", tmp_path / "image", tmp_path / "volume"
    pinned_and_pushed(team, s3)
    image_copy(team, image)
    assert (image / "data.dvc").is_file() and not (image / "data").exists() and not (image / ".git").exists()

    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "LLMOPS_PROJECT_DIR": str(image),
           "LLMOPS_HOME": str(volume), "LLMOPS_DVC_REMOTE": "s3://dvc-remote/llmops", "AWS_ENDPOINT_URL": s3}
    result = subprocess.run([str(REPO / "docker" / "worker-start.sh"), "cat", "data/rows.jsonl"], cwd=tmp_path,
                            env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    # pulled, then the worker's command ran in the project
    assert result.stdout.endswith('{"text": "pinned version"}\n')
    assert [p for p in (volume / "dvc" / "cache").rglob("*") if p.is_file()], "the cache belongs in the volume"

    from dvc.repo import Repo

    monkeypatch.chdir(image)
    with Repo(str(image)) as repo:
        assert repo.status(targets=["data.dvc"]) == {}  # what data.dvc pins, byte for byte
