"""Where runs, models and artifacts go: config, then environment, then the embedded default; secrets masked."""

from pathlib import Path

import pytest

from llmops.config.schema import TrackingConfig
from llmops.flows.remote import check_dispatch, work_pool
from llmops.io.errors import ConfigError
from llmops.objectives import load_config
from llmops.store import settings
from llmops.tracking import log as tracking

REPO = Path(__file__).resolve().parents[2]


def test_tracking_uri_config_then_environment_then_the_workspace(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    assert settings.tracking_uri(TrackingConfig()) == f"sqlite:///{home / 'mlflow' / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.team:5000")
    assert settings.tracking_uri(TrackingConfig()) == "http://mlflow.team:5000"
    assert settings.registry_uri(TrackingConfig()) == "http://mlflow.team:5000"
    configured = TrackingConfig(tracking_uri="http://other:5000")
    assert settings.tracking_uri(configured) == "http://other:5000"
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", "http://registry:5000")
    assert settings.registry_uri(configured) == "http://registry:5000"
    assert settings.registry_uri(configured.model_copy(update={"registry_uri": "http://mine:1"})) == "http://mine:1"


def test_the_client_talks_to_the_environment_s_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.team:5000")
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", "http://registry.team:5000")
    client = tracking.client(TrackingConfig())
    assert client.tracking_uri == "http://mlflow.team:5000"
    assert client._registry_uri == "http://registry.team:5000"


@pytest.mark.parametrize(("uri", "shown"), [
    ("http://alice:s3cret@mlflow.team:5000", "http://alice:***@mlflow.team:5000"),
    ("https://ghp_token123@git.team/repo.git", "https://***@git.team/repo.git"),
    ("postgresql://mlflow:pw@db:5432/mlflow?sslmode=require&password=pw2",
     "postgresql://mlflow:***@db:5432/mlflow?sslmode=require&password=***"),
    ("s3://bucket/path?X-Amz-Signature=abc", "s3://bucket/path?X-Amz-Signature=***"),
    ("sqlite:////tmp/x/mlflow.db", "sqlite:////tmp/x/mlflow.db"),
    ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
    # an unescaped @ in a password: all of it is masked, not the part after the last @
    ("http://someone:p@ss@127.0.0.1:5000", "http://someone:***@127.0.0.1:5000"),
    # inside any text (an error message, a log line): every URI in it
    ("cannot reach http://alice:s3cret@mlflow.team:5000 (store https://ghp_token123@git.team/x), mail bob@team.org",
     "cannot reach http://alice:***@mlflow.team:5000 (store https://***@git.team/x), mail bob@team.org"),
    (None, "none"),
])
def test_credentials_are_masked(uri: str | None, shown: str) -> None:
    assert settings.mask(uri) == shown
    for secret in ("s3cret", "ghp_token123", "pw2", "abc", "p@ss", "ss@"):
        assert secret not in settings.mask(uri)


def test_local_stores_and_servers() -> None:
    assert settings.is_local_store("sqlite:////tmp/mlflow.db") and settings.is_local_store("/tmp/mlruns")
    assert settings.is_local_store("file:///tmp/mlruns")
    assert not settings.is_local_store("http://127.0.0.1:5000") and not settings.is_local_store("databricks")


def test_the_s3_endpoint_comes_from_aws_or_mlflow_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "MLFLOW_S3_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    assert settings.storage_options("s3://artifacts/llmops") == {}
    monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", "http://minio:9000")
    assert settings.storage_options("s3://artifacts/llmops") == {"client_kwargs": {"endpoint_url": "http://minio:9000"}}
    assert settings.storage_options("gs://artifacts/llmops") == {}
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://other:9000")  # botocore reads it itself
    assert settings.storage_options("s3://artifacts/llmops") == {}


def test_a_stage_sent_to_a_pool_needs_a_shared_store_and_a_server() -> None:
    config_path = REPO / "configs" / "tiny_sft_cpu.yaml"
    local = load_config(config_path)
    assert work_pool("train", local) is None and work_pool("evaluate", local) is None
    check_dispatch(local, None)  # the embedded default sends nothing anywhere
    without_store = load_config(config_path, ["launch.work_pool=gpu"])
    with pytest.raises(ConfigError, match="launch.work_pool=gpu runs a stage on another machine: set workspace.remote"):
        check_dispatch(without_store, "http://127.0.0.1:4200/api")
    placed_settings = ["launch.work_pool=gpu", "workspace.remote=s3://artifacts/x"]
    placed = load_config(config_path, placed_settings)
    assert work_pool("train", placed) == "gpu"
    with pytest.raises(ConfigError, match="needs a Prefect server with a worker on that pool: set PREFECT_API_URL"):
        check_dispatch(placed, None)
    check_dispatch(placed, "http://127.0.0.1:4200/api")
    # a pool's worker starts one machine: the other nodes of a torchrun training would never come
    nodes = ["train.nodes=2", "train.distributed=ddp"]
    with pytest.raises(ConfigError, match=r"^launch.work_pool=gpu with train.nodes=2 starts one machine's launcher: "
                                          r"set engine.name=ray \(Ray Train starts"):
        check_dispatch(load_config(config_path, [*placed_settings, *nodes]), "http://127.0.0.1:4200/api")
    check_dispatch(load_config(config_path, [*placed_settings, *nodes, "engine.name=ray"]), "http://127.0.0.1:4200/api")
