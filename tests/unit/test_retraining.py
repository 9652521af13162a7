"""Retrain once per data version, and never on a file still being written."""

from pathlib import Path

from llmops.config.schema import PipelineConfig
from llmops.data.versions import PinnedData
from llmops.flows.events import data_updated
from llmops.registry.retraining import still_being_written, version_trained_on
from llmops.tracking import log as tracking


def test_a_file_that_keeps_growing_is_still_being_written(tmp_path: Path) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text('{"text": "a"}\n')
    waited: list[float] = []

    def copy_goes_on(seconds: float) -> None:  # while the flow waits, the copy appends more bytes
        waited.append(seconds)
        with data.open("a") as handle:
            handle.write('{"text": "b"}\n')

    assert still_being_written([data], 5.0, sleep=copy_goes_on) == data
    assert 4.0 < waited[0] <= 5.0


def test_a_file_that_stopped_changing_is_complete(tmp_path: Path) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text('{"text": "a"}\n')
    waited: list[float] = []
    assert still_being_written([data], 5.0, sleep=waited.append) is None and len(waited) == 1  # quiet for 5 s
    old = tmp_path / "old.jsonl"
    old.write_text("{}\n")
    import os

    os.utime(old, (1_000_000_000, 1_000_000_000))
    never: list[float] = []
    assert still_being_written([old], 5.0, sleep=never.append) is None and never == []  # no wait at all


def test_one_version_per_md5_and_config(home: Path) -> None:
    config = PipelineConfig.model_validate({"register": {"model_name": "watched"}})
    assert version_trained_on(config, "abc.dir") is None
    client = tracking.client(config.tracking)
    client.create_registered_model("watched")
    client.create_model_version("watched", "file:///nowhere", tags={"dvc_data_md5": "abc.dir",
                                                                    "config_hash": config.digest()})
    client.create_model_version("watched", "file:///nowhere", tags={"dvc_data_md5": "abc.dir",
                                                                    "config_hash": "another config"})
    assert version_trained_on(config, "abc.dir") == "1"
    assert version_trained_on(config, "def.dir") is None


def test_the_data_event_names_the_dataset_md5_and_commit() -> None:
    event = data_updated(PinnedData(dvc_file="data.dvc", path="data", md5="abc.dir"), "push", "0123abcd", False)
    assert event.event == "llmops.data.updated"
    assert event.resource.id == "llmops.dataset.data"
    assert event.resource["llmops.dataset.md5"] == "abc.dir" and event.resource["llmops.dataset.stored"] == "true"
    assert event.payload == {"md5": "abc.dir", "dvc_file": "data.dvc", "path": "data", "action": "push",
                             "stored": True, "git_commit": "0123abcd", "git_dirty": False}
    added = data_updated(PinnedData(dvc_file="data.dvc", path="data", md5="abc.dir"), "add", "0123abcd", True)
    assert added.resource["llmops.dataset.stored"] == "false"
