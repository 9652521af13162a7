"""Faults outside the code: a tracking server that is down, an S3 store that fails or loses writes, a disk that
fills up. Each ends in a clean result or one clear line, and nothing half-done is ever reused."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import httpx
import pytest
from dvc.repo import Repo
from moto.server import ThreadedMotoServer
from typer.testing import CliRunner

from llmops.cli.app import app
from llmops.data import versions
from llmops.data.ingest import read_records
from llmops.data.synthetic import instruction_records
from llmops.io.files import write_jsonl
from tests.integration.stack import free_port

pytestmark = pytest.mark.reliability
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
runner = CliRunner()


@pytest.fixture(autouse=True)
def no_progress_handler_of_an_earlier_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """An earlier test's in-process `llmops run` may have left its progress handler on the llmops logger, printing
    to whatever console a later command captures; a command run on its own has none."""
    import logging

    from rich.logging import RichHandler

    logger = logging.getLogger("llmops")
    monkeypatch.setattr(logger, "handlers", [h for h in logger.handlers if not isinstance(h, RichHandler)])


def one_line(output: str) -> str:
    lines = output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), output
    return lines[0]


# (a) the tracking server is down when the run starts


@pytest.mark.parametrize("where", ["override", "environment"])
def test_unreachable_tracking_server_stops_the_run_before_any_work(where: str, home: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    uri = f"http://someone:s3cret@127.0.0.1:{free_port()}"  # nothing listens there
    args = ["run", str(REPO / "configs" / "tiny_sft_cpu.yaml"), "data.path=/nonexistent.jsonl"]
    if where == "override":
        args.append(f"tracking.tracking_uri={uri}")
    else:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    started = time.monotonic()
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    line = one_line(result.output)
    assert "MLflow tracking server http://127.0.0.1:" in line and "is unreachable" in line, line
    assert "s3cret" not in result.output and "someone" not in result.output
    assert time.monotonic() - started < 20
    assert not (home / "artifacts").exists()  # no stage ran: the missing data file was never even looked for


# (b) the S3 store fails during `llmops data push`


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict]:
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    for name, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    endpoint = f"http://127.0.0.1:{port}"
    httpx.post(f"{endpoint}/moto-api/reset")  # the fake store's state lives in this process: start empty
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="datasets")
    state = {"endpoint": endpoint, "port": port, "server": server}
    yield state
    state["server"].stop()


@pytest.fixture
def dvc_project(s3: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A git + DVC project with an S3 remote and a pinned data folder of three files."""
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    subprocess.run(["git", "init", "-q"], cwd=project, check=True)
    Repo.init(str(project))
    with Repo(str(project)) as repo, repo.config.edit() as settings:
        settings["remote"]["store"] = {"url": "s3://datasets/llmops", "endpointurl": s3["endpoint"]}
        settings["core"]["remote"] = "store"
    for number in range(3):
        (project / "data" / f"part{number}.jsonl").write_text(f'{{"text": "part {number}"}}\n' * (number + 1))
    monkeypatch.chdir(project)
    assert runner.invoke(app, ["data", "add", "data"]).exit_code == 0
    monkeypatch.setattr(versions, "PUSH_BACKOFF_SECONDS", 0.2)
    return project


def remote_listing(s3: dict) -> set[str]:
    found = boto3.client("s3", endpoint_url=s3["endpoint"]).list_objects_v2(Bucket="datasets").get("Contents", [])
    return {item["Key"].removeprefix("llmops/") for item in found if item["Key"].startswith("llmops/")}


def cache_listing(project: Path) -> set[str]:
    cache = project / ".dvc" / "cache"
    return {path.relative_to(cache).as_posix() for path in cache.rglob("*") if path.is_file()}


@pytest.mark.slow
def test_a_write_the_store_acknowledges_but_loses_is_found_and_sent_again(s3: dict, dvc_project: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The store answers 200 to the first upload of each object and drops it: `dvc push` alone reports success."""
    from moto.s3.models import S3Backend

    upload = S3Backend.put_object
    seen: set[str] = set()

    def lose_first_upload(backend: S3Backend, bucket_name: str, key_name: str, *args: object, **kwargs: object):
        first = key_name not in seen
        seen.add(key_name)
        # the first upload of each object is stored where nobody will look for it, and answered 200 all the same
        return upload(backend, bucket_name, f"lost/{key_name}" if first else key_name, *args, **kwargs)

    monkeypatch.setattr(S3Backend, "put_object", lose_first_upload)
    result = runner.invoke(app, ["data", "push"])
    assert result.exit_code == 0, result.output
    assert "it holds all 4 objects of the pinned data" in result.stdout
    assert remote_listing(s3) == cache_listing(dvc_project) and len(seen) == 4


@pytest.mark.slow
def test_a_store_outage_during_push_is_retried_until_it_is_back(s3: dict, dvc_project: Path) -> None:
    s3["server"].stop()  # down when the push starts, back two seconds later

    def restart() -> None:
        time.sleep(2)
        s3["server"] = ThreadedMotoServer(ip_address="127.0.0.1", port=s3["port"])
        s3["server"].start()

    threading.Thread(target=restart).start()
    started = time.monotonic()
    result = runner.invoke(app, ["data", "push"])
    assert result.exit_code == 0, result.output
    assert remote_listing(s3) == cache_listing(dvc_project)
    assert time.monotonic() - started < 120


@pytest.mark.slow
def test_a_store_that_stays_down_ends_the_push_in_one_line(s3: dict, dvc_project: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's own retries would only make the test longer
    s3["server"].stop()
    started = time.monotonic()
    result = runner.invoke(app, ["data", "push"])
    assert result.exit_code == 2
    assert "dvc push to the default remote failed after 4 attempts" in one_line(result.stderr)
    assert time.monotonic() - started < 180
    s3["server"] = ThreadedMotoServer(ip_address="127.0.0.1", port=s3["port"])
    s3["server"].start()
    assert remote_listing(s3) != cache_listing(dvc_project)  # and the verification knows it was not pushed


# (d) the disk fills up while an artifact is written


def test_a_full_disk_during_an_artifact_write_leaves_nothing_to_reuse(home: Path, tmp_path: Path) -> None:
    data = tmp_path / "rows.jsonl"
    write_jsonl(data, instruction_records(rows=3000, seed=4))
    config = tmp_path / "config.yaml"
    config.write_text(f"data:\n  path: {data}\n")
    env = {**os.environ, "LLMOPS_HOME": str(home), "PYTHONPATH": str(REPO)}
    limit = data.stat().st_size // 4  # the data is read whole, its copy cannot be written whole

    def small_disk() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk

    stage = [str(BIN / "llmops"), "stage", "ingest", "--config", str(config)]
    full = subprocess.run(stage, cwd=REPO, env=env, capture_output=True, text=True, preexec_fn=small_disk)
    assert full.returncode == 2, full.stdout + full.stderr
    line = one_line(full.stderr)
    assert "ingest artifact" in line and "File too large" in line and "nothing of it was kept" in line
    ingest_dir = home / "artifacts" / "ingest"
    assert [p.suffix for p in ingest_dir.iterdir()] == [".lock"]  # no partial folder, no record
    assert not (home / "records" / "ingest.json").exists()

    again = subprocess.run(stage, cwd=REPO, env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "ingest: computed" in again.stdout
    records = read_records(next(p for p in ingest_dir.iterdir() if p.is_dir()))
    assert sum(1 for _ in records) == 3000
