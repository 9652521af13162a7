"""The sweep's space file: what it accepts, and one line naming the file and the field for each thing it refuses;
the config a sweep runs with."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmops.config.schema import TrackingConfig
from llmops.io.errors import ConfigError, UserError
from llmops.objectives import load_config
from llmops.pipeline.sweep import Space, read_space, with_evaluation
from llmops.pipeline.sweep_study import overrides_of, startup_trials, storage_url
from tests.sources import REPO

DEFAULT = REPO / "configs" / "default.yaml"


def space_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "space.yaml"
    path.write_text(text)
    return path


def refusal(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as caught:
        read_space(space_file(tmp_path, text))
    message = str(caught.value)
    assert "\n" not in message and message.startswith(str(tmp_path / "space.yaml"))
    assert isinstance(caught.value, UserError)
    return message


def test_every_distribution_is_read(tmp_path: Path) -> None:
    space = read_space(space_file(tmp_path, """
params:
  train.learning_rate: {distribution: log-uniform, low: 1.0e-4, high: 1.0e-2}
  train.warmup_ratio: {distribution: uniform, low: 0, high: 0.2}
  train.batch_size: {distribution: int, low: 8, high: 64, step: 8}
  train.lr_scheduler: {distribution: categorical, choices: [cosine, linear]}
  validate.max_bad_fraction: {distribution: uniform, low: 0.0, high: 0.1}
sampler: random
startup_trials: 3
eval_steps: 10
"""))
    kinds = {d.field: d.distribution for d in space.params}
    assert kinds == {"train.learning_rate": "log-uniform", "train.warmup_ratio": "uniform", "train.batch_size": "int",
                     "train.lr_scheduler": "categorical", "validate.max_bad_fraction": "uniform"}
    assert space.params[2].step == 8 and space.params[3].choices == ("cosine", "linear")
    assert (space.sampler, space.pruner, space.startup_trials, space.eval_steps) == ("random", "median", 3, 10)
    assert startup_trials(space, 6) == 3
    assert startup_trials(space.model_copy(update={"startup_trials": None}), 6) == 2


@pytest.mark.parametrize(("text", "expected"), [
    ("params:\n  train.learnin_rate: {distribution: uniform, low: 0, high: 1}\n",
     "train.learnin_rate: unknown config field (train has: epochs, "),
    ("params:\n  trian.epochs: {distribution: uniform, low: 1, high: 2}\n",
     "trian.epochs: unknown config field (the config has: data, validate, "),
    ("params:\n  train: {distribution: uniform, low: 1, high: 2}\n", "train: a section, not a field"),
    ("params:\n  train.epochs.x: {distribution: uniform, low: 1, high: 2}\n", "train.epochs is a value, not a section"),
    ("params:\n  launch.work_pool: {distribution: categorical, choices: [gpu]}\n",
     "launch.work_pool: says where things run"),
    # no key covers it: trials differing only in it would share one trained model
    ("params:\n  launch.retries: {distribution: int, low: 0, high: 3}\n", "launch.retries: says where things run"),
])
def test_unknown_fields_are_refused(tmp_path: Path, text: str, expected: str) -> None:
    assert expected in refusal(tmp_path, text)


@pytest.mark.parametrize(("text", "expected"), [
    ("params:\n  train.batch_size: {distribution: log-uniform, low: 8, high: 64}\n",
     "train.batch_size: takes whole numbers: use int or categorical, not log-uniform"),
    ("params:\n  train.lr_scheduler: {distribution: uniform, low: 0, high: 1}\n",
     "train.lr_scheduler: is not a number: use categorical, not uniform"),
    ("params:\n  train.packing: {distribution: int, low: 0, high: 1}\n",
     "train.packing: is not a number: use categorical, not int"),
    ("params:\n  train.lr_scheduler: {distribution: categorical, choices: [cosine, sawtooth]}\n",
     "train.lr_scheduler: choice 'sawtooth' is not a value the field takes"),
    ("params:\n  train.batch_size: {distribution: categorical, choices: [16, true]}\n",
     "train.batch_size: choice True is not a value the field takes"),
    ("params:\n  train.epochs: {distribution: gaussian, low: 1, high: 2}\n",
     "train.epochs: expected {distribution: one of log-uniform, uniform, int, categorical"),
    ("params:\n  train.epochs: {distribution: uniform, low: 1, high: 2, step: 1}\n",
     "train.epochs: step: not a setting of a uniform distribution; it takes: low, high"),
    ("params:\n  train.batch_size: {distribution: int, low: 8.5, high: 64}\n",
     "train.batch_size: low and high must be whole numbers"),
])
def test_distributions_that_do_not_fit_the_field_are_refused(tmp_path: Path, text: str, expected: str) -> None:
    assert expected in refusal(tmp_path, text)


@pytest.mark.parametrize(("text", "expected"), [
    ("params:\n  train.learning_rate: {distribution: uniform, low: -0.1, high: 0.1}\n",
     "train.learning_rate: low -0.1 is outside the field's allowed range (input should be greater than or equal "
     "to 0)"),
    ("params:\n  train.warmup_ratio: {distribution: uniform, low: 0.1, high: 1.0}\n",
     "train.warmup_ratio: high 1.0 is outside the field's allowed range (input should be less than 1)"),
    ("params:\n  train.batch_size: {distribution: int, low: 0, high: 8}\n",
     "train.batch_size: low 0.0 is outside the field's allowed range"),
    ("params:\n  train.learning_rate: {distribution: log-uniform, low: 0, high: 0.1}\n",
     "train.learning_rate: a log-uniform distribution needs low > 0 (got 0.0)"),
    ("params:\n  train.epochs: {distribution: uniform, low: 3, high: 2}\n",
     "train.epochs: low must be below high (got low 3, high 2)"),
    ("params:\n  train.batch_size: {distribution: int, low: 8, high: 64, step: 0}\n",
     "train.batch_size: step must be a whole number >= 1"),
    ("params:\n  register.min_improvement: {distribution: categorical, choices: [0.1, -1]}\n",
     "register.min_improvement: choice -1 is not a value the field takes"),
])
def test_bounds_outside_the_field_range_are_refused(tmp_path: Path, text: str, expected: str) -> None:
    assert expected in refusal(tmp_path, text)


@pytest.mark.parametrize(("text", "expected"), [
    ("", "params: expected a mapping of config fields"),
    ("params: {}\n", "params: expected a mapping of config fields"),
    ("params:\n  train.epochs: {distribution: uniform, low: 1, high: 2}\nsampler: grid\n", "sampler: input should be"),
    ("params:\n  train.epochs: {distribution: uniform, low: 1, high: 2}\nprunner: none\n",
     "prunner: unknown key; expected one of: eval_steps, params, pruner, sampler, startup_trials"),
    ("params: [1\n", "not valid YAML"),
])
def test_malformed_space_files_are_refused(tmp_path: Path, text: str, expected: str) -> None:
    assert expected in refusal(tmp_path, text)


def test_a_missing_space_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="space.yaml: space file not found"):
        read_space(tmp_path / "space.yaml")


def test_the_study_lives_beside_the_tracking_database_not_in_it() -> None:
    # MLflow and Optuna both keep their schema revision in an alembic_version table: never one database
    assert storage_url(TrackingConfig(tracking_uri="sqlite:////w/mlflow/mlflow.db"), None) == (
        "sqlite:////w/mlflow/mlflow-studies.db")
    assert storage_url(TrackingConfig(tracking_uri="postgresql://u:p@db:5432/mlflow"), None) == (
        "postgresql://u:p@db:5432/mlflow_studies")
    assert storage_url(TrackingConfig(tracking_uri="http://mlflow:5000"), "sqlite:////s.db") == "sqlite:////s.db"
    with pytest.raises(ConfigError, match="pass --storage"):
        storage_url(TrackingConfig(tracking_uri="http://mlflow:5000"), None)


def test_trial_values_become_overrides_read_back_as_their_types() -> None:
    assert overrides_of({"train.learning_rate": 0.001, "train.lr_scheduler": "cosine", "train.packing": False,
                         "train.eval_steps": None}) == [
        "train.learning_rate=0.001", 'train.lr_scheduler="cosine"', "train.packing=false", "train.eval_steps=null"]


def test_the_shipped_spaces_are_read() -> None:
    for path in sorted((Path(__file__).resolve().parents[2] / "configs" / "sweeps").glob("*.yaml")):
        space = read_space(path)
        assert {dimension.field for dimension in space.params} >= {"train.learning_rate"}, path


def test_the_sweep_s_config_is_the_one_its_overrides_load() -> None:
    """The sweep loads its config once and sets the evaluation the pruner reads on it; loading the file again with
    the overrides it returns (as a trial does) gives the same config."""
    config = load_config(DEFAULT)
    dimension = {"field": "train.learning_rate", "distribution": "log-uniform", "low": 1e-4, "high": 1e-2}
    evaluated, overrides = with_evaluation(config, Space.model_validate({"params": [dimension], "eval_steps": 7}))
    assert overrides == ["train.eval_steps=7"] and evaluated.train.eval_steps == 7
    again = load_config(DEFAULT, overrides)
    assert evaluated == again and evaluated.digest() == again.digest()
    # without a step of its own the space evaluates at each logging step
    evaluated, overrides = with_evaluation(config, Space.model_validate({"params": [dimension]}))
    assert overrides == [f"train.eval_steps={config.train.logging_steps}"] == ["train.eval_steps=25"]
    # no pruner, or a space that draws eval_steps itself: the config as it is
    assert with_evaluation(config, Space.model_validate({"params": [dimension], "pruner": "none"})) == (config, [])
    drawn = {"field": "train.eval_steps", "distribution": "int", "low": 5, "high": 50}
    assert with_evaluation(config, Space.model_validate({"params": [drawn], "eval_steps": 7})) == (config, [])
