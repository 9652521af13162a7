"""Dataset versions on an S3-compatible remote: a local moto server stands in for the bucket."""

import hashlib
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
import yaml
from moto.server import ThreadedMotoServer
from typer.testing import CliRunner

from flows.cli import app

pytestmark = pytest.mark.integration
runner = CliRunner()
DVC = str(Path(sys.executable).parent / "dvc")  # the environment's own, whether or not it is on PATH


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    for name, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    endpoint = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="datasets")
    yield endpoint
    server.stop()


def git(*args: str, cwd: Path) -> None:
    subprocess.run(["git", "-c", "user.email=ci@example.com", "-c", "user.name=ci", *args], cwd=cwd, check=True,
                   capture_output=True)


def invoke(*args: str) -> str:
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


def test_push_pull_and_verify_a_dataset_version(s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    git("init", "-q", cwd=project)
    subprocess.run([DVC, "init", "-q"], cwd=project, check=True)
    subprocess.run([DVC, "remote", "add", "-d", "store", "s3://datasets/llmops"], cwd=project, check=True)
    subprocess.run([DVC, "remote", "modify", "store", "endpointurl", s3], cwd=project, check=True)
    rows = project / "data" / "rows.jsonl"
    rows.write_text('{"text": "version one"}\n')
    monkeypatch.chdir(project)

    added = invoke("data", "add", "data")
    pinned = yaml.safe_load((project / "data.dvc").read_text())["outs"][0]["md5"]
    assert pinned in added
    git("add", "-A", cwd=project)
    git("commit", "-qm", "data v1", cwd=project)
    assert "pushed 2 files to the default DVC remote" in invoke("data", "push")
    keys = [o["Key"] for o in boto3.client("s3", endpoint_url=s3).list_objects_v2(Bucket="datasets")["Contents"]]
    file_md5 = hashlib.md5(rows.read_bytes()).hexdigest()
    assert any(key.endswith(file_md5[2:]) for key in keys) and any(key.endswith(".dir") for key in keys)

    # a second version, then back to the first one from the remote alone
    rows.write_text('{"text": "version two"}\n')
    invoke("data", "add", "data")
    assert yaml.safe_load((project / "data.dvc").read_text())["outs"][0]["md5"] != pinned
    git("checkout", "data.dvc", cwd=project)
    subprocess.run(["rm", "-rf", "data", ".dvc/cache"], cwd=project, check=True)
    assert "pulled 2 files" in invoke("data", "pull", "--remote", "store")  # the file and its folder listing
    assert rows.read_text() == '{"text": "version one"}\n'
    status = subprocess.run([DVC, "status"], cwd=project, capture_output=True, text=True, check=True)
    assert "up to date" in status.stdout
