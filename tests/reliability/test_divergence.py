"""A training that diverges from the start never reaches the registry: `llmops run` ends in one line (exit 2), the
MLflow run is marked failed with that line, holds the NaN figures it saw, and no version is registered."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from mlflow import MlflowClient
from typer.testing import CliRunner

from llmops.cli.app import app
from llmops.config.schema import TrackingConfig
from llmops.data.synthetic import instruction_records
from llmops.io.files import write_jsonl
from llmops.tracking import log as tracking

pytestmark = [pytest.mark.reliability, pytest.mark.slow, pytest.mark.integration]
CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_sft_cpu.yaml")
runner = CliRunner()


def run_diverging(tmp_path: Path, *settings: str) -> tuple[str, MlflowClient, str]:
    """`llmops run` on the tiny SFT config; (its error lines, the tracking client, the MLflow run id)."""
    data = tmp_path / "instructions.jsonl"
    write_jsonl(data, instruction_records(rows=400, seed=3))
    result = runner.invoke(
        app,
        [
            "run",
            CONFIG,
            f"data.path={data}",
            "train.max_steps=30",
            "train.logging_steps=5",
            "register.model_name=diverged",
            *settings,
        ],
    )
    assert result.exit_code == 2, result.output
    errors = [line[line.index("error: ") :] for line in result.output.splitlines() if "error: " in line]
    assert len(errors) == 1, result.output
    client = tracking.client(TrackingConfig())
    (run,) = client.search_runs([tracking.experiment_id(TrackingConfig())])
    assert run.info.status == "FAILED"
    assert client.search_model_versions("name = 'diverged'") == []
    assert "train" not in {tag.removeprefix("stage.") for tag in run.data.tags if tag.startswith("stage.")}
    return errors[0], client, run.info.run_id


def test_a_learning_rate_of_ten_ends_the_run_before_evaluation_and_registration(tmp_path: Path) -> None:
    error, client, run_id = run_diverging(tmp_path, "train.learning_rate=10", "train.save_steps=10")
    assert error.startswith("error: training diverged: the loss rose from ")
    assert "at step 1 to " in error and "lower train.learning_rate" in error
    losses = client.get_metric_history(run_id, "train/loss")
    assert [m.step for m in losses][0] == 1 and losses[-1].value > 2 * losses[0].value


def test_a_loss_gone_to_nan_stops_at_its_step_naming_the_last_good_checkpoint(tmp_path: Path) -> None:
    error, client, run_id = run_diverging(
        tmp_path, "train.learning_rate=1e30", "train.nonfinite.action=stop", "train.save_steps=1"
    )
    assert "error: training stopped at step " in error and "train.nonfinite.action is stop" in error
    step = int(error.split("training stopped at step ")[1].split(":")[0])
    counted = client.get_metric_history(run_id, "train/nonfinite_steps")
    assert counted[-1].value == 1 and counted[-1].step == step
    kept = Path(error.split("the last good checkpoint, kept, is ")[1].split(";")[0])
    assert kept.name == f"checkpoint-{step - 1}" and (kept / "model.safetensors").is_file()
    assert any(math.isnan(m.value) or m.value > 1e30 for m in client.get_metric_history(run_id, "train/grad_norm"))


def test_a_sweep_trial_that_diverges_fails_and_the_sweep_goes_on(tmp_path: Path) -> None:
    import optuna

    data = tmp_path / "instructions.jsonl"
    write_jsonl(data, instruction_records(rows=240, seed=31))
    space = tmp_path / "space.yaml"
    space.write_text("params:\n  train.learning_rate: {distribution: categorical, choices: [10.0]}\npruner: none\n")
    result = runner.invoke(
        app,
        [
            "sweep",
            CONFIG,
            f"data.path={data}",
            "train.max_steps=16",
            "train.logging_steps=4",
            "train.batch_size=8",
            "register.model_name=swept",
            "--space",
            str(space),
            "--trials",
            "2",
            "--study",
            "diverging",
        ],
    )
    assert result.exit_code == 1, result.output  # both trials ran, and failed: nothing to register
    assert "error: no trial of study diverging completed: nothing registered" in result.output
    from llmops.pipeline.sweep_study import storage_url

    trials = optuna.load_study(study_name="diverging", storage=storage_url(TrackingConfig(), None)).get_trials()
    assert [t.state.name for t in trials] == ["FAIL", "FAIL"]
    client = tracking.client(TrackingConfig())
    failures = [
        run.data.tags.get("failure", "")
        for run in client.search_runs([tracking.experiment_id(TrackingConfig())])
        if run.data.tags.get("mlflow.runName", "").startswith("diverging-trial-")
    ]
    assert len(failures) == 2 and all(f.startswith("DivergedError: training diverged: the loss rose") for f in failures)
