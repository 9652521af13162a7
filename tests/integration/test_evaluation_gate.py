"""Evaluation that tells models apart, and the registry gate, on models trained here (moved from tests/unit: every
test trains models)."""

import json
import logging
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlflow
import pytest
import torch
from typer.testing import CliRunner

from llmops.cli.app import app
from llmops.config.schema import PipelineConfig
from llmops.data.synthetic import glossary_records
from llmops.flows.pipeline import training_pipeline
from llmops.io.files import write_jsonl
from llmops.tracking import log as tracking
from tests.conftest import REPO, tiny_config
from tests.helpers import data_stages, stage

pytestmark = pytest.mark.slow
runner = CliRunner()
CONFIG = str(REPO / "configs" / "tiny_sft_cpu.yaml")
NAME = "llmops-tiny-sft"


@pytest.fixture(autouse=True)
def progress_handlers_removed_after() -> Iterator[None]:
    """`llmops run` in this process adds its progress handler to the llmops logger: taken off again after the test,
    so that it does not print into a later test's captured console."""
    logger = logging.getLogger("llmops")
    handlers = list(logger.handlers)
    yield
    logger.handlers = handlers


def test_long_form_answers_are_judged_by_rouge_l_which_separates_trained_from_untrained(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "glossary.jsonl", glossary_records(500, seed=11))
    config = tiny_config("tiny_sft_cpu.yaml", tmp_path / "glossary.jsonl", "tokenize.vocab_size=512",
                         "tokenize.max_length=64", "train.max_steps=40", "train.batch_size=16",
                         "train.learning_rate=1e-2", "evaluate.max_new_tokens=40", "evaluate.max_examples=40")
    deduped, tokenized = data_stages(config)
    figures = stage("evaluate", config, stage("train", config, tokenized), tokenized, deduped).figures
    print("FIGURES " + figures.model_dump_json(include={"metrics", "intervals", "gain_over_baseline"}))
    assert figures.primary_metric == "rouge_l"
    assert figures.primary_reason.startswith("reference answers are long (p95 2")
    trained, untrained = figures.intervals["trained"], figures.intervals["untrained"]
    assert trained["rouge_l"]["low"] > untrained["rouge_l"]["high"]  # intervals that do not overlap
    assert figures.metrics["trained"]["exact_match"] == figures.metrics["untrained"]["exact_match"] == 0.0
    assert figures.gain_over_baseline["rouge_l"]["low"] > 0
    assert figures.metrics["trained"]["chrf"] > figures.metrics["untrained"]["chrf"]
    assert figures.metrics["trained"]["completion_loss"] < figures.metrics["untrained"]["completion_loss"]
    assert figures.metrics["trained"]["truncation_rate"] < figures.metrics["untrained"]["truncation_rate"]


def test_the_gate_refuses_a_useless_model_and_keeps_a_worse_one_challenger(instruction_file: Path) -> None:
    """Three runs of the flow on the same data: learning rate 0 (no alias, even as the first version), a model
    that learned (champion), and one that learned less (challenger: the champion is re-scored on the frozen set)."""
    data = [f"data.path={instruction_file}", "evaluate.max_examples=30", "evaluate.max_new_tokens=12"]
    result = runner.invoke(app, ["run", CONFIG, *data, "train.learning_rate=0", "train.max_steps=3"])
    assert result.exit_code == 1 and not isinstance(result.exception, Exception), (result.output, result.exception)
    last = result.stdout.strip().splitlines()[-1]  # MLflow prints its own lines on stderr
    assert re.fullmatch(r"trained model does not beat its baseline on exact_match \(0 vs 0\)", last), last
    mlflow_client = tracking.client(PipelineConfig().tracking)
    assert not mlflow_client.get_registered_model(NAME).aliases
    assert mlflow_client.get_model_version(NAME, "1").tags["decision"].startswith(
        "no alias: it does not beat the untrained model on exact_match")
    pinned = mlflow_client.get_registered_model(NAME).tags["frozen_eval.md5"]

    by_loss = [*data, "evaluate.primary_metric=completion_loss"]
    good = training_pipeline(CONFIG, [*by_loss, "train.max_steps=15"])["registration"]
    assert (good["version"], good["alias"]) == ("2", "champion") and good["reason"].startswith("no champion yet")
    # a recorded figure that would lose to anything: the gate must score the champion, not read it
    mlflow_client.set_model_version_tag(NAME, "2", "metric.trained.completion_loss", "99")
    worse = training_pipeline(CONFIG, [*by_loss, "train.max_steps=3"])["registration"]
    assert worse["gain_over_baseline"]["completion_loss"]["low"] > 0  # it did learn something
    assert (worse["version"], worse["alias"]) == ("3", "challenger")
    assert worse["reason"].startswith("does not beat champion version 2: completion_loss")
    comparison = worse["comparison"]
    assert comparison["frozen_md5"] == pinned
    assert comparison["champion"]["completion_loss"] == pytest.approx(good["metrics"]["trained"]["completion_loss"],
                                                                      rel=1e-4)
    assert comparison["candidate"]["completion_loss"] > comparison["champion"]["completion_loss"]
    assert str(mlflow_client.get_model_version_by_alias(NAME, "champion").version) == "2"
    shows_the_card(mlflow_client)
    shows_lineage(mlflow_client)


def shows_the_card(mlflow_client: Any) -> None:
    """The card is logged with the model and is the version's description (cut at a section if too long)."""
    version = mlflow_client.get_model_version(NAME, "3")
    logged = Path(mlflow.artifacts.download_artifacts(f"runs:/{version.run_id}/model/model_card.md")).read_text()
    for heading in ("## Model", "## Data", "## Training", "## Evaluation", "## Against the champion",
                    "## Limitations", "## License", "## How to load", "## Held-out samples"):
        assert heading in logged, heading
    assert "Version 2, re-scored now on the frozen evaluation set (30 examples" in logged
    assert version.description.startswith("# llmops-tiny-sft") and "## How to load" in version.description
    assert logged.startswith(version.description.split("\n\n(Clipped")[0])


def shows_lineage(mlflow_client: Any) -> None:
    """`llmops models show` prints where a version came from, and the event that started its run when tagged."""
    mlflow_client.set_model_version_tag(NAME, "3", "trigger_event_id", "evt-42")
    result = runner.invoke(app, ["models", "show", f"{NAME}@challenger", "--json"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert shown["version"] == "3" and shown["aliases"] == ["challenger"] and shown["seed"] == "0"
    assert shown["data_md5"] == "untracked" and len(shown["git_commit"]) == 40 and len(shown["tokenizer_hash"]) == 64
    assert shown["packages"]["torch"] == torch.__version__ and "cuda" in shown["packages"]
    uuid.UUID(shown["prefect_flow_run_id"])
    assert shown["trigger_event_id"] == "evt-42" and "max_steps: 3" in shown["config"]
    assert [(m["alias"], m["version"]) for m in shown["alias_history"]] == [("challenger", "3")]
    result = runner.invoke(app, ["models", "show", f"{NAME}/2"])
    assert result.exit_code == 0 and "tokenizer_hash" in result.output and "resolved config" in result.output
