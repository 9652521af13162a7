"""The whole flow on the embedded default (Prefect ephemeral API, MLflow on SQLite), on a tiny config."""

import json
import subprocess
import uuid
from pathlib import Path

import pytest

from llmops.data.synthetic import instruction_records
from llmops.flows.pipeline import training_pipeline
from llmops.io.files import write_jsonl
from llmops.objectives import load_config
from llmops.tracking import log as tracking

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "tiny_sft_cpu.yaml")


def test_run_reuse_and_retrain_on_changed_data(instruction_file: Path) -> None:
    overrides = [f"data.path={instruction_file}"]
    config = load_config(CONFIG, overrides)
    first = training_pipeline(CONFIG, overrides)
    registration = first["registration"]
    assert (registration["version"], registration["alias"], registration["reused"]) == ("1", "champion", False)
    assert set(first["stages"].values()) == {"computed"}
    metrics = registration["metrics"]
    assert metrics["trained"]["exact_match"] > metrics["untrained"]["exact_match"]
    assert metrics["trained"]["completion_perplexity"] < metrics["untrained"]["completion_perplexity"] / 10

    mlflow_client = tracking.client(config.tracking)
    version = mlflow_client.get_model_version_by_alias(config.registry.model_name, "champion")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert version.tags["git_commit"] == head
    assert version.tags["config_hash"] == config.digest()
    assert version.tags["dvc_data_md5"] == "untracked"  # the test's data lives outside any DVC repo
    uuid.UUID(version.tags["prefect_flow_run_id"])
    first_run = mlflow_client.get_run(first["mlflow_run_id"])
    assert first_run.info.status == "FINISHED"
    assert first_run.data.metrics["validate/rows_read"] == 1500
    assert first_run.data.params["train.epochs"] == str(config.train.epochs)
    # MLflow's conventions: source tags, the splits as datasets, a description, metrics grouped by prefix
    tags = first_run.data.tags
    assert tags["mlflow.source.git.commit"] == head and tags["mlflow.source.type"] == "LOCAL"
    assert tags["mlflow.source.name"] == f"training_pipeline ({CONFIG})"
    assert tags["mlflow.note.content"].startswith(f"{config.registry.model_name}/1 → champion; exact_match ")
    assert "; cost: " in tags["mlflow.note.content"]
    datasets = {(found.dataset.name, found.tags[0].value): found.dataset for found in first_run.inputs.dataset_inputs}
    assert set(datasets) == {("instructions-train", "training"), ("instructions-eval", "evaluation")}
    rows = {name: json.loads(found.profile)["num_rows"] for (name, _), found in datasets.items()}
    assert rows == {"instructions-train": first_run.data.metrics["dedup/train_rows_weighted"],
                    "instructions-eval": first_run.data.metrics["dedup/eval_rows"]}
    # untracked data: the digest is the split's content key, the same for both splits of one dedup artifact
    assert {found.digest for found in datasets.values()} == {tags["stage.dedup.key"][:36]}
    assert all("/" in name for name in first_run.data.metrics)
    assert len(mlflow_client.get_metric_history(first_run.info.run_id, "train/loss")) > 3

    second = training_pipeline(CONFIG, overrides)
    assert set(second["stages"].values()) == {"reused"}
    assert second["registration"]["reused"] and second["registration"]["version"] == "1"
    second_run = mlflow_client.get_run(second["mlflow_run_id"])
    assert second_run.data.tags["stage.tokenize"] == "reused" and second_run.data.tags["stage.train"] == "reused"
    assert len(mlflow_client.search_model_versions(f"name = '{config.registry.model_name}'")) == 1

    write_jsonl(instruction_file, instruction_records(rows=1600, seed=8))
    third = training_pipeline(CONFIG, overrides)
    assert third["stages"]["tokenize"] == "computed" and third["stages"]["train"] == "computed"
    assert third["registration"]["version"] == "2"
    # both compared on version 1's pinned held-out rows, not on this run's own
    comparison = third["registration"]["comparison"]
    pinned = mlflow_client.get_registered_model(config.registry.model_name).tags["frozen_eval.md5"]
    assert comparison["frozen_md5"] == pinned == version.tags["frozen_eval_md5"]
    better = comparison["candidate"]["exact_match"] > comparison["champion"]["exact_match"]
    assert third["registration"]["alias"] == ("champion" if better else "challenger")
    assert third["registration"]["previous_champion"] == "1"


def test_bad_data_stops_the_flow_before_training(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    write_jsonl(bad, [{"instruction": "x", "output": ""}] * 5 + [{"instruction": "x", "output": "y"}])
    from llmops.data.validate import DataQualityError

    with pytest.raises(DataQualityError, match=r"5 of 6 rows failed validation"):
        training_pipeline(CONFIG, [f"data.path={bad}"])


def test_a_stage_that_fails_on_the_users_input_is_not_tried_again(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Ingest is retried twice (a read can fail for a moment), but a missing data file would only be missing again,
    seconds later: the run ends at the first try."""
    from llmops.data import ingest
    from llmops.data.readers import DataSourceError

    tries = []
    real = ingest.input_fingerprints  # the first thing the ingest task does: its key reads the sources
    monkeypatch.setattr(ingest, "input_fingerprints",
                        lambda *args, **kwargs: tries.append(1) or real(*args, **kwargs))
    with pytest.raises(DataSourceError, match="no data file found"):
        training_pipeline(CONFIG, [f"data.path={tmp_path / 'nowhere.jsonl'}"])
    assert len(tries) == 1


def test_retrain_on_data_change_runs_only_when_the_data_changed(instruction_file: Path) -> None:
    from llmops.flows.retrain import retrain_on_data_change

    overrides = [f"data.path={instruction_file}", "register.model_name=llmops-retrain-test"]
    first = retrain_on_data_change(CONFIG, overrides, settle_seconds=1)
    assert first["retrained"] and first["reason"] == "no version registered yet"
    assert first["registration"]["version"] == "1"
    unchanged = retrain_on_data_change(CONFIG, overrides, settle_seconds=1)
    assert not unchanged["retrained"] and unchanged["version"] == "1"
    write_jsonl(instruction_file, instruction_records(rows=1550, seed=9))
    changed = retrain_on_data_change(CONFIG, overrides, settle_seconds=1)
    assert changed["retrained"] and changed["registration"]["version"] == "2"
    # an event announcing a version this data is not pinned at starts nothing
    announced = retrain_on_data_change(CONFIG, overrides, data_md5="0" * 32 + ".dir", settle_seconds=1)
    assert not announced["retrained"] and "the event announced data md5 0000" in announced["reason"]
