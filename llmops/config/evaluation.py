"""The evaluate and register sections: what the held-out scoring and the benchmarks measure, and what the gate asks
of a new version before it earns the champion alias."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from llmops.config.section import Section

# lm-eval task names: its registry's own (hellaswag, arc_easy, ...) and the `task:` of local YAML files
TASK_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"


class EvaluateConfig(Section):
    # the held-out examples scored (the first ones of the eval split); also the size of a pinned frozen set
    max_examples: int = Field(200, ge=1)
    max_new_tokens: int = Field(32, ge=1)
    batch_size: int = Field(64, ge=1)
    # the metric that decides between models (one the objective reports); None: chosen by the objective from the data
    primary_metric: str | None = None
    # lm-evaluation-harness tasks run on the trained model and on its starting point: names of local tasks (in
    # benchmark_paths, or shipped with llmops) or of the harness's own tasks (their data comes from the hub)
    benchmarks: list[str] = Field(default_factory=list)
    # folders of local lm-eval YAML tasks, relative to where llmops runs; a task's data files are relative to its YAML
    benchmark_paths: list[str] = Field(default_factory=list)
    # the first N documents of each task (None: all of them)
    benchmark_limit: int | None = Field(None, ge=1)

    @field_validator("benchmarks")
    @classmethod
    def task_names(cls, names: list[str]) -> list[str]:
        import re

        for name in names:
            if not re.fullmatch(TASK_NAME, name):
                raise ValueError(f"{name!r} is not a task name (letters, digits, '_', '.', '-'); a local task's YAML "
                                 "goes in a folder named by evaluate.benchmark_paths")
        keys = [metric_key(name) for name in names]
        if len(set(keys)) != len(keys):
            raise ValueError("a task is named twice (names that differ only in case, '.' or '-' log as one metric)")
        return names


def metric_key(task: str) -> str:
    """A task's name as part of an MLflow metric name: lower case, '.' and '-' as '_' (a task name is held to
    TASK_NAME, so nothing else can reach a metric's name)."""
    return task.lower().replace(".", "_").replace("-", "_")


class GuardConfig(Section):
    """What the candidate may lose against the champion (the base model, for a first version) and still be champion.

    A metric guard compares a metric the objective reports on the frozen evaluation set; a benchmark guard compares
    a task of evaluate.benchmarks on its main metric. `max_drop` is in the metric's own units."""

    metric: str | None = None
    benchmark: str | None = None
    max_drop: float = Field(ge=0)

    @model_validator(mode="after")
    def one_subject(self) -> GuardConfig:
        if (self.metric is None) == (self.benchmark is None):
            raise ValueError("a guard names either a metric or a benchmark, e.g. {benchmark: arc_easy, max_drop: 0.02}")
        return self

    @property
    def subject(self) -> str:
        return self.metric or self.benchmark or ""


class RegisterConfig(Section):
    # one name, no path: letters, digits, '_', '.', '-'
    model_name: str = Field("llmops-default", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
    # the primary metric must beat the untrained or base model's by more than this, or no version is champion
    min_gain_over_baseline: float = Field(0.0, ge=0)
    # and beat the champion's on the frozen evaluation set by at least this (a tie never promotes)
    min_improvement: float = Field(0.0, ge=0)
    # what the candidate may lose and still be champion; `{metric: max_drop}` is short for metric guards
    guards: list[GuardConfig] = Field(default_factory=list)

    @field_validator("model_name")
    @classmethod
    def no_parent_steps(cls, name: str) -> str:
        if ".." in name:
            raise ValueError("a model name cannot hold '..'")
        return name

    @field_validator("guards", mode="before")
    @classmethod
    def metric_map(cls, value: Any) -> Any:
        """`{truncation_rate: 0.05}` reads as [{metric: truncation_rate, max_drop: 0.05}]."""
        if isinstance(value, dict):
            return [{"metric": name, "max_drop": drop} for name, drop in value.items()]
        return value

    @field_validator("guards")
    @classmethod
    def one_guard_each(cls, guards: list[GuardConfig]) -> list[GuardConfig]:
        subjects = [guard.subject for guard in guards]
        twice = sorted({subject for subject in subjects if subjects.count(subject) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} guarded twice")
        return guards

    def metric_guards(self) -> dict[str, float]:
        return {guard.metric: guard.max_drop for guard in self.guards if guard.metric is not None}

    def benchmark_guards(self) -> dict[str, float]:
        return {guard.benchmark: guard.max_drop for guard in self.guards if guard.benchmark is not None}
