"""Standard benchmarks at the gate, on models trained here. A first version trained on numbers, Roman numerals and
dates is scored on the shipped lm-eval task and on a local one (dates written in words, in bits per byte) in the
evaluate stage, logged to MLflow and its card, and accepted by a guard against its untrained start. A second
version trained longer on numbers and Roman numerals only beats it on the frozen set (numbers) but has lost dates:
the guard refuses it the champion alias, naming the task and both scores. `llmops evaluate NAME/N --benchmark TASK`
then gives a registered version's score outside a run."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator
from pathlib import Path

import mlflow
import pytest
from typer.testing import CliRunner

from llmops.cli.app import app
from llmops.config.schema import PipelineConfig
from llmops.data.synthetic import date_task, roman_task, words_task
from llmops.flows.pipeline import training_pipeline
from llmops.io.files import write_jsonl
from llmops.tracking import log as tracking
from tests.conftest import REPO

pytestmark = pytest.mark.slow
runner = CliRunner()
CONFIG = str(REPO / "configs" / "tiny_sft_cpu.yaml")
NAME = "llmops-tiny-sft"
SHIPPED, DATES = "llmops_number_words", "dates_in_words"


@pytest.fixture(autouse=True)
def progress_handlers_removed_after() -> Iterator[None]:
    logger = logging.getLogger("llmops")
    handlers = list(logger.handlers)
    yield
    logger.handlers = handlers


def write_dates_task(folder: Path) -> Path:
    """A local lm-eval task in a folder of its own, its data beside its YAML and named relative to it: how well a
    model predicts dates written in words (bits per byte, lower is better)."""
    folder.mkdir()
    rng = random.Random(5)
    write_jsonl(folder / "dates.jsonl", [date_task(rng) for _ in range(40)])
    (folder / "dates.yaml").write_text(
        f"task: {DATES}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: dates.jsonl\n"
        "test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{output}}\"\n"
        "metric_list:\n  - metric: bits_per_byte\n    aggregation: bits_per_byte\n    higher_is_better: false\n")
    return folder


def write_data(folder: Path) -> dict[str, Path]:
    rng = random.Random(11)
    files = {"all": [rng.choice([words_task, roman_task, date_task])(rng) for _ in range(1500)],
             "no_dates": [rng.choice([words_task, roman_task])(rng) for _ in range(1500)],
             "frozen": [words_task(rng) for _ in range(40)]}
    for name, rows in files.items():
        write_jsonl(folder / f"{name}.jsonl", rows)
    return {name: folder / f"{name}.jsonl" for name in files}


def test_a_benchmark_guard_accepts_a_first_version_and_refuses_one_that_forgot(tmp_path: Path) -> None:
    tasks, data = write_dates_task(tmp_path / "tasks"), write_data(tmp_path)
    common = [f"data.eval_sources=[{{path: {data['frozen']}}}]", "evaluate.max_examples=40",
              "evaluate.max_new_tokens=12", "evaluate.primary_metric=completion_loss",
              f"evaluate.benchmark_paths=[{tasks}]", f"register.guards=[{{benchmark: {DATES}, max_drop: 0.5}}]"]
    first = training_pipeline(CONFIG, [f"data.path={data['all']}", *common, "train.max_steps=30",
                                       f"evaluate.benchmarks=[{DATES}, {SHIPPED}]"])["registration"]
    print("FIRST", json.dumps(first["benchmarks"]))
    trained, untrained = first["benchmarks"]["trained"], first["benchmarks"]["untrained"]
    assert trained[DATES]["metric"] == "bits_per_byte" and not trained[DATES]["higher_is_better"]
    assert trained[DATES]["score"] < untrained[DATES]["score"] and trained[DATES]["samples"] == 40
    assert trained[SHIPPED]["metric"] == "acc" and trained[SHIPPED]["samples"] == 100
    assert trained[SHIPPED]["high"] - trained[SHIPPED]["score"] == pytest.approx(1.96 * trained[SHIPPED]["stderr"])
    assert (first["version"], first["alias"]) == ("1", "champion") and first["reason"].startswith("no champion yet")
    shows_the_scores_in_mlflow(first, trained[SHIPPED])

    second = training_pipeline(CONFIG, [f"data.path={data['no_dates']}", *common, "train.max_steps=60",
                                        f"evaluate.benchmarks=[{DATES}]"])["registration"]
    comparison = second["comparison"]
    print("SECOND", json.dumps(comparison["benchmarks"]), comparison["gains"]["completion_loss"])
    assert comparison["gains"]["completion_loss"]["gain"] > 0  # it beats the champion on the frozen set
    mine, champion = comparison["benchmarks"]["candidate"][DATES], comparison["benchmarks"]["champion"][DATES]
    assert champion["score"] == pytest.approx(trained[DATES]["score"], rel=1e-3)  # the champion, run again now
    assert mine["score"] - champion["score"] > 0.5
    assert (second["version"], second["alias"]) == ("2", "challenger")
    assert (f"but a guard fails: benchmark {DATES}: bits_per_byte {mine['score']:.4g} (no standard error from the "
            f"harness) against champion version 1's bits_per_byte {champion['score']:.4g}") in second["reason"]
    mlflow_client = tracking.client(PipelineConfig().tracking)
    assert str(mlflow_client.get_model_version_by_alias(NAME, "champion").version) == "1"

    alone = runner.invoke(app, ["evaluate", f"{NAME}/1", "--benchmark", DATES, "--tasks", str(tasks), "--json"])
    assert alone.exit_code == 0, alone.output
    again = json.loads(alone.stdout[alone.stdout.index("{"):])
    assert again["model"] == f"{NAME}/1" and again["scores"][DATES]["score"] == pytest.approx(trained[DATES]["score"],
                                                                                              rel=1e-3)
    unknown = runner.invoke(app, ["evaluate", f"{NAME}/1", "--benchmark", "no_such_task"])
    assert unknown.exit_code == 2 and "no_such_task" in unknown.output.strip().splitlines()[-1]


def shows_the_scores_in_mlflow(registration: dict, shipped: dict) -> None:
    mlflow_client = tracking.client(PipelineConfig().tracking)
    version = mlflow_client.get_model_version(NAME, registration["version"])
    metrics = mlflow_client.get_run(version.run_id).data.metrics
    assert metrics[f"evaluate/benchmarks.trained.{SHIPPED}.score"] == pytest.approx(shipped["score"])
    assert metrics[f"evaluate/benchmarks.untrained.{SHIPPED}.stderr"] > 0
    assert version.tags[f"benchmark.trained.{SHIPPED}"].startswith(f"acc {shipped['score']:.6g} ± ")
    card = Path(mlflow.artifacts.download_artifacts(f"runs:/{version.run_id}/model/model_card.md")).read_text()
    assert "## Benchmarks" in card and f"| {SHIPPED} | acc | {shipped['score']:.4g} [" in card
