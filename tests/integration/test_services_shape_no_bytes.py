"""The services the keys leave out cannot change an artifact: every stage, run once on one worker with tracking in
the workspace's SQLite store and no shared store, and once on two workers, tracking to an MLflow server, sharing
artifacts through an S3 bucket, in another workspace path, makes the same keys and the same bytes. (Ray as the
engine is held to the same in test_engines.)"""

from __future__ import annotations

from pathlib import Path

import boto3
import pytest

from llmops.objectives import load_config
from llmops.registry import presence
from llmops.store.artifacts import verify
from tests.helpers import run_all_stages
from tests.integration.test_s3_remote import s3  # noqa: F401 (the bucket server, as a fixture)
from tests.reliability.servers import start_mlflow
from tests.sources import REPO

pytestmark = pytest.mark.slow


def test_every_stage_makes_the_same_bytes_whatever_the_services(instruction_file: Path, tmp_path: Path,
                                                                s3: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    bucket = s3
    boto3.client("s3", endpoint_url=bucket).create_bucket(Bucket="artifacts")
    monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", bucket)  # the variable an MLflow-on-S3 team already sets
    shipped = REPO / "configs" / "tiny_sft_cpu.yaml"
    common = [f"data.path={instruction_file}", "train.max_steps=6", "evaluate.max_examples=20"]
    monkeypatch.setenv("LLMOPS_HOME", str(tmp_path / "a"))
    alone = run_all_stages(load_config(shipped, [*common, "engine.workers=1"]), "services: none")

    server, port = start_mlflow(tmp_path)
    try:
        monkeypatch.setenv("LLMOPS_HOME", str(tmp_path / "elsewhere" / "b"))
        served = load_config(shipped, [*common, "engine.workers=2", f"tracking.tracking_uri=http://127.0.0.1:{port}",
                                       "workspace.remote=s3://artifacts/team"])
        shared = run_all_stages(served, "services: all")
        # what an up-to-date run asks of a tracking server, through its REST API
        registered = shared["register"]
        aliases = presence.version_aliases(served.tracking, registered.model_name, registered.version)
        assert aliases == ([registered.alias] if registered.alias else [])
        assert presence.version_aliases(served.tracking, registered.model_name, "99") is None
    finally:
        server.terminate()
        server.wait(timeout=30)

    built = [name for name, record in alone.items() if hasattr(record, "hash")]
    assert built == ["ingest", "validate", "dedup", "tokenize", "report", "train", "evaluate"]
    for name in built:
        first, second = alone[name], shared[name]
        assert not second.reused, f"{name} was taken from the first workspace, not built again"
        assert (first.key, first.hash) == (second.key, second.hash), f"{name}: the services changed its bytes"
        assert verify(second.dir) is None and second.dir.is_relative_to(tmp_path / "elsewhere")
    listed = boto3.client("s3", endpoint_url=bucket).list_objects_v2(Bucket="artifacts", Prefix="team/")
    assert f"team/train/{shared['train'].key}/record.json" in {item["Key"] for item in listed["Contents"]}
