"""A registered version's presence and aliases, read from MLflow's own SQLite store without MLflow's client, as an
up-to-date `llmops run` asks them (the tracking server's REST API is asked in test_services_shape_no_bytes)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow import MlflowClient

from llmops.config.schema import TrackingConfig
from llmops.registry import presence


@pytest.fixture
def store(tmp_path: Path) -> tuple[TrackingConfig, MlflowClient]:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    client.create_registered_model("m")
    for _ in range(2):
        client.create_model_version("m", source=str(tmp_path))
    client.set_registered_model_alias("m", "champion", "2")
    client.set_registered_model_alias("m", "canary", "2")
    return TrackingConfig(tracking_uri=uri), client


def test_a_version_s_aliases_its_absence_and_an_unchanged_run(store: tuple[TrackingConfig, MlflowClient]) -> None:
    config, client = store
    assert presence.version_aliases(config, "m", "2") == ["canary", "champion"]
    assert presence.version_aliases(config, "m", "1") == []
    assert presence.version_aliases(config, "m", "3") is None
    assert presence.version_aliases(config, "other", "1") is None
    # a last run whose version is still registered is unchanged: with the aliases it has now, and no cost line
    summary = {"stages": {"train": "reused"},
               "registration": {"model_name": "m", "version": 1, "alias": "champion", "cost": {"usd": 1.5}}}
    assert presence.still_registered(config, summary) == {"stages": {"train": "reused"}, "registration": {
        "model_name": "m", "version": 1, "alias": None, "cost": None, "reused": True}}
    assert presence.still_registered(config, {"registration": {"model_name": "m", "version": None}}) is None
    assert presence.still_registered(TrackingConfig(tracking_uri="postgresql://db/mlflow"), summary) is None
    client.delete_model_version("m", "1")
    assert presence.version_aliases(config, "m", "1") is None
    assert presence.still_registered(config, summary) is None
    two = {"registration": {"model_name": "m", "version": "2"}}
    assert presence.still_registered(config, two)["registration"]["alias"] == "canary, champion"


def test_what_cannot_be_asked_cheaply_is_unknown(tmp_path: Path) -> None:
    assert presence.version_aliases(TrackingConfig(tracking_uri=f"sqlite:///{tmp_path / 'none.db'}"), "m", "1") is None
    broken = tmp_path / "broken.db"
    broken.write_text("not a database")
    with pytest.raises(presence.Unknown):
        presence.version_aliases(TrackingConfig(tracking_uri=f"sqlite:///{broken}"), "m", "1")
    with pytest.raises(presence.Unknown):
        presence.version_aliases(TrackingConfig(tracking_uri="postgresql://db/mlflow"), "m", "1")
    with pytest.raises(presence.Unknown):  # nothing listens there
        presence.version_aliases(TrackingConfig(tracking_uri="http://127.0.0.1:9"), "m", "1")

