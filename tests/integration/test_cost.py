"""What a run cost, on a tiny config: on the register record, the MLflow run, the version and its card, in
`llmops runs` and in the run's last lines; and what an identical run saved by reusing everything."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from llmops.cli.app import app
from llmops.cli.io import console
from llmops.config.schema import PipelineConfig
from llmops.data.synthetic import instruction_records
from llmops.io.files import write_jsonl
from llmops.pipeline.stages import STAGES
from llmops.registry import accounting
from llmops.registry.register import show_version
from llmops.tracking import log as tracking
from llmops.tracking.cost import padding_tokens
from tests.conftest import REPO, tiny_config
from tests.helpers import count_parses, run_all_stages

pytestmark = [pytest.mark.integration, pytest.mark.slow]
CONFIG = str(REPO / "configs" / "tiny_sft_cpu.yaml")
ARTIFACT_STAGES = {spec.name for spec in STAGES if spec.artifact}
runner = CliRunner()


@pytest.fixture
def lossy_file(tmp_path: Path) -> Path:
    """The tiny dataset with rows validation quarantines (an empty answer) and exact duplicates of kept rows."""
    rows = instruction_records(rows=1500, seed=7)
    path = tmp_path / "lossy.jsonl"
    write_jsonl(path, rows + [{"instruction": f"say {n}", "output": ""} for n in range(20)] + rows[:30])
    return path


def test_a_run_carries_its_cost_and_an_identical_run_reports_what_reuse_saved(lossy_file: Path) -> None:
    config = tiny_config("tiny_sft_cpu.yaml", lossy_file, "cost.device_hour={cpu: 0.05}")
    first = run_all_stages(config, "cost-first")
    spent = first["register"].cost
    assert spent is not None and set(spent.stages) == ARTIFACT_STAGES
    assert not any(stage.reused for stage in spent.stages.values()) and spent.reused_device_hours == 0
    assert spent.computed_device_hours == pytest.approx(sum(s.seconds for s in spent.stages.values()) / 3600)
    trained, tokenized = first["train"].figures, first["tokenize"].figures
    train_stage = spent.stages["train"]
    assert (train_stage.device, train_stage.devices) == ("cpu", 1)
    assert train_stage.seconds >= trained.seconds  # the build holds the training and what surrounds it
    # the useful tokens are the ones trained on; the counted losses are the stages' own figures
    assert spent.useful_tokens == trained.tokens > 0
    assert spent.lost.padding == padding_tokens(trained.tokens, trained.padding_fraction)
    assert spent.lost.truncated == round(tokenized.train.truncated_tokens * trained.epochs)
    # the 20 rows quarantined and the duplicates (the 30 added, and the data's own), each as long as a kept training
    # row, as often as training rows go to training, seen every epoch
    per_row = tokenized.train.tokens / tokenized.train.rows
    dedup = first["dedup"].figures
    share = dedup.train_rows_weighted / dedup.rows_out
    removed = dedup.duplicates + dedup.near_duplicates
    assert first["validate"].figures.rows_quarantined == 20 and removed >= 30
    assert spent.lost.quarantined_est == round(20 * per_row * share * trained.epochs) > 0
    assert spent.lost.duplicates_est == round(removed * per_row * share * trained.epochs) > 0
    assert spent.computed_cost == pytest.approx(spent.computed_device_hours * 0.05)
    assert spent.cost_per_million_useful_tokens == pytest.approx(spent.computed_cost / trained.tokens * 1e6)

    mlflow_client = tracking.client(config.tracking)
    run = run_named(config, "cost-first")
    assert run.data.metrics["cost/computed_device_hours"] == pytest.approx(spent.computed_device_hours)
    assert run.data.metrics["cost/useful_tokens"] == spent.useful_tokens
    assert run.data.metrics["cost/stages.train.device_hours"] == pytest.approx(train_stage.device_hours)
    assert run.data.metrics["cost/lost.quarantined_est"] == spent.lost.quarantined_est
    assert run.data.tags["cost.devices"] == "cpu" and run.data.tags["cost.summary"] == accounting.line(spent)
    name, number = config.registry.model_name, first["register"].version
    version = mlflow_client.get_model_version(name, number)
    assert float(version.tags["cost.computed_device_hours"]) == pytest.approx(spent.computed_device_hours, rel=1e-5)
    assert "## Cost" in version.description and accounting.line(spent) in version.description
    shown = show_version(config.tracking, f"{name}/{number}")["cost"]
    assert float(shown["useful_tokens"]) == spent.useful_tokens and float(shown["computed_cost"]) > 0
    listed = tracking.recent_runs(config.tracking, 5)[0]["cost"]
    assert listed["computed_device_hours"] == pytest.approx(spent.computed_device_hours)

    second = run_all_stages(config, "cost-second")
    saved = second["register"].cost
    assert saved is not None and all(stage.reused for stage in saved.stages.values())
    assert second["register"].reused and second["register"].version == number
    assert (saved.computed_device_hours, saved.computed_cost, saved.cost_per_million_useful_tokens) == (0, 0, 0)
    assert saved.reused_device_hours == pytest.approx(spent.computed_device_hours)
    assert saved.saved_cost == pytest.approx(spent.computed_cost)
    assert (saved.useful_tokens, saved.lost) == (spent.useful_tokens, spent.lost)
    assert accounting.line(saved).startswith("0 device-hours computed (none), ")


def run_named(config: PipelineConfig, name: str) -> Any:
    """The MLflow run of that name."""
    mlflow_client = tracking.client(config.tracking)
    experiment = mlflow_client.get_experiment_by_name(config.tracking.experiment)
    (run,) = mlflow_client.search_runs([experiment.experiment_id], filter_string=f"attributes.run_name = '{name}'")
    return run


def cost_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("cost: ")]
    assert len(lines) == 1, output
    return lines[0]


def test_the_summary_says_the_cost_in_one_line_priced_or_not(instruction_file: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(console, "width", 250)  # the runs table whole, not folded into a narrow terminal
    base = ["run", CONFIG, f"data.path={instruction_file}"]
    parses = count_parses(monkeypatch)
    priced = runner.invoke(app, [*base, "cost.device_hour={cpu: 0.05, H100: 2.5}"])
    assert priced.exit_code == 0, priced.output
    # the command loads the config, and the flow it starts takes that one rather than parsing the file again
    assert parses == {"read": 1, "parse": 1}
    line = cost_line(priced.output)
    assert "device-hours computed (cpu), 0 reused (saved);" in line and "useful tokens (lost: " in line
    assert "; price " in line and line.endswith(" per 1M useful tokens")

    # prices shape nothing: the same run without them reuses every stage, and says only hours
    unpriced = runner.invoke(app, [*base, "--force"])  # the flow again, not the up-to-date answer
    assert unpriced.exit_code == 0, unpriced.output
    line = cost_line(unpriced.output)
    assert line.startswith("cost: 0 device-hours computed (none), ") and " reused (saved); " in line
    assert "price" not in line and "per 1M" not in line and line.endswith(" padding)")

    listed = runner.invoke(app, ["runs", "--config", CONFIG])
    assert listed.exit_code == 0, listed.output
    header = next(row for row in listed.output.splitlines() if "device-hours" in row)
    assert "saved" in header and "useful tokens" in header and "cost" in header
    shown = runner.invoke(app, ["models", "show", "llmops-tiny-sft/1", "--config", CONFIG, "--json"])
    assert shown.exit_code == 0, shown.output
    cost = json.loads(shown.output)["cost"]
    assert float(cost["computed_device_hours"]) > 0 and float(cost["cost_per_million_useful_tokens"]) > 0
    assert cost["devices"] == "cpu"
