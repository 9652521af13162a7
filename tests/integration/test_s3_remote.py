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

from llmops.cli.app import app

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


@pytest.mark.slow  # a bucket server and DVC subprocesses
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


STAGES_UP_TO_TRAIN = ("ingest", "validate", "dedup", "tokenize", "train")


def run_stages(config, names: tuple[str, ...] = STAGES_UP_TO_TRAIN) -> dict:
    from llmops.pipeline.runner import run_stage
    from llmops.pipeline.stages import stage

    records: dict = {}
    for name in names:
        records[name] = run_stage(name, config, [records[up] for up in stage(name).upstream])
    return records


@pytest.mark.slow
def test_a_second_workspace_takes_every_artifact_from_an_s3_remote(s3: str, instruction_file: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from llmops.objectives import load_config
    from llmops.store.artifacts import verify

    boto3.client("s3", endpoint_url=s3).create_bucket(Bucket="artifacts")
    monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", s3)  # the variable an MLflow-on-S3 team already sets
    config = load_config(Path(__file__).resolve().parents[2] / "configs" / "tiny_sft_cpu.yaml", [
        f"data.path={instruction_file}", "train.max_steps=4", "workspace.remote=s3://artifacts/team"])
    monkeypatch.setenv("LLMOPS_HOME", str(tmp_path / "machine-a"))
    built = run_stages(config)
    assert not any(record.reused for record in built.values())
    bucket = boto3.client("s3", endpoint_url=s3)
    keys = {o["Key"] for o in bucket.list_objects_v2(Bucket="artifacts", Prefix="team/")["Contents"]}
    assert f"team/train/{built['train'].key}/model/model.safetensors" in keys
    assert {f"team/{name}/{record.key}/record.json" for name, record in built.items()} <= keys

    monkeypatch.setenv("LLMOPS_HOME", str(tmp_path / "machine-b"))
    with caplog.at_level(logging.INFO, logger="llmops.workspace"):
        again = run_stages(config)
    pulled = {r.getMessage().split()[0] for r in caplog.records if r.getMessage().endswith("from the shared store")
              and "pulled" in r.getMessage()}
    assert pulled == set(STAGES_UP_TO_TRAIN)
    for name, record in again.items():  # the same artifacts, nothing recomputed (train's seconds would differ)
        assert record.reused and record.hash == built[name].hash and record.figures == built[name].figures, name
        assert record.dir.is_relative_to(tmp_path / "machine-b") and verify(record.dir) is None

    # a byte flipped in the bucket: the next machine sees it, trains itself and replaces the bad copy
    weights = f"team/train/{built['train'].key}/model/model.safetensors"
    body = bytearray(bucket.get_object(Bucket="artifacts", Key=weights)["Body"].read())
    body[len(body) // 2] ^= 0xFF
    bucket.put_object(Bucket="artifacts", Key=weights, Body=bytes(body))
    monkeypatch.setenv("LLMOPS_HOME", str(tmp_path / "machine-c"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llmops.workspace"):
        third = run_stages(config)
    assert third["tokenize"].reused and not third["train"].reused
    assert any("train artifact" in r.message and "in the shared store is not used (1 file(s) differ from the "
               "manifest, e.g. model/model.safetensors)" in r.message for r in caplog.records)
    assert verify(third["train"].dir) is None
    repaired = bucket.get_object(Bucket="artifacts", Key=weights)["Body"].read()
    assert repaired == (third["train"].dir / "model" / "model.safetensors").read_bytes()
