"""The shipped tool-calling config learns (slow): the whole flow runs configs/tiny_tools_cpu.yaml as it ships, on the
data `llmops data init` writes for it (made here by the same generator; test_shipped_configs runs `data init` in a
fresh clone); the run's MLflow metrics show the trained model making the held-out calls (right tool, right
arguments) that the untrained model does not."""

from pathlib import Path

import pytest

from llmops.data.synthetic import example_data
from llmops.flows.pipeline import training_pipeline
from llmops.io.files import write_jsonl
from llmops.objectives import load_config
from llmops.tracking import log as tracking
from tests.integration.stack import REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow]
CALL_METRICS = ("tool_call_accuracy", "tool_name_accuracy", "tool_arguments_accuracy")


def test_the_shipped_tool_config_learns_to_call_the_right_tool_with_the_right_arguments(
        tmp_path: Path) -> None:
    data = tmp_path / "tools.jsonl"
    write_jsonl(data, example_data()["data/tools.jsonl"]())
    path = REPO / "configs" / "tiny_tools_cpu.yaml"
    outcome = training_pipeline(str(path), [f"data.path={data}"])
    assert outcome["stages"]["train"] == "computed"

    run = tracking.client(load_config(path).tracking).get_run(outcome["mlflow_run_id"])
    metrics = run.data.metrics
    trained = {name: metrics[f"evaluate/metrics.trained.{name}"] for name in CALL_METRICS}
    untrained = {name: metrics[f"evaluate/metrics.untrained.{name}"] for name in CALL_METRICS}
    assert untrained["tool_name_accuracy"] < 0.1, untrained  # a model that has seen nothing writes no call
    assert trained["tool_name_accuracy"] > 0.9, trained
    for name in ("tool_call_accuracy", "tool_arguments_accuracy"):
        assert trained[name] >= untrained[name] + 0.5, (trained, untrained)
    # the gain is clear of chance: the low end of its bootstrap interval, over the paired held-out calls
    assert metrics["evaluate/gain_over_baseline.tool_call_accuracy.low"] > 0.3, metrics
