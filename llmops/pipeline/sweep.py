"""A sweep's search space, read from its YAML file and checked against the config model.

The space names config fields by their dotted paths (`train.learning_rate`) and the distribution
each is drawn from: log-uniform, uniform, int or categorical. A field that does not exist, a
distribution that does not fit the field's type, and bounds or choices outside what the field
accepts (its pydantic constraints) are each one line naming the file and the field.
"""

from __future__ import annotations

import hashlib
import json
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, Field, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from llmops.config.files import read_yaml
from llmops.config.schema import PipelineConfig, is_placement
from llmops.config.section import Section
from llmops.io.errors import ConfigError
from llmops.pipeline.stages import STAGES

DISTRIBUTIONS = ("log-uniform", "uniform", "int", "categorical")
# the keys each distribution takes besides `distribution`
SETTINGS = {"log-uniform": ("low", "high"), "uniform": ("low", "high"), "int": ("low", "high", "step", "log"),
            "categorical": ("choices",)}
Choice = str | int | float | bool | None


class Dimension(Section):
    """One config field and the distribution its values are drawn from."""

    field: str
    distribution: Literal["log-uniform", "uniform", "int", "categorical"]
    low: float | None = None
    high: float | None = None
    # int: the spacing of the values drawn (1), and whether they are drawn on a log scale
    step: int = 1
    log: bool = False
    choices: tuple[Choice, ...] = ()


class Space(Section):
    """The space file: the dimensions, and how the study samples and prunes."""

    params: tuple[Dimension, ...]
    # tpe (Optuna's TPESampler) or random
    sampler: Literal["tpe", "random"] = "tpe"
    # median: a trial whose evaluation loss is worse than the median of earlier trials at the same step is stopped
    pruner: Literal["median", "none"] = "median"
    # trials sampled at random before TPE models, and finished before the pruner prunes; None: a third of the
    # trials asked for, between 1 and 5
    startup_trials: int | None = Field(None, ge=1)
    # evaluate the eval split every N training steps (what the pruner reads); None: train.eval_steps when the config
    # sets it, else train.logging_steps
    eval_steps: int | None = Field(None, ge=1)

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


def read_space(path: str | Path) -> Space:
    """The space file, every dimension checked against the config model; one line naming the file and field if not."""
    source = Path(path)
    if not source.is_file():
        raise ConfigError(f"{source}: space file not found")
    raw = read_yaml(source)
    known = set(Space.model_fields)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{source}: {unknown[0]}: unknown key; expected one of: {', '.join(sorted(known))}")
    params = raw.get("params")
    if not isinstance(params, dict) or not params:
        raise ConfigError(f"{source}: params: expected a mapping of config fields (e.g. train.learning_rate) to "
                          "their distributions")
    dimensions = tuple(dimension(source, str(name), spec) for name, spec in params.items())
    try:
        return Space.model_validate({**raw, "params": dimensions})
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ConfigError(f"{source}: {where}: {first['msg'].lower()} (got {first.get('input')!r})") from None


def with_evaluation(config: PipelineConfig, space: Space) -> tuple[PipelineConfig, list[str]]:
    """The config as the sweep runs it, and the overrides that give it when loaded again (a trial's): the pruner
    reads the evaluation loss during training, every `eval_steps` (the space's, else the config's, else each logging
    step)."""
    if space.pruner == "none" or any(d.field == "train.eval_steps" for d in space.params):
        return config, []
    steps = space.eval_steps or config.train.eval_steps or config.train.logging_steps
    if steps == config.train.eval_steps:
        return config, []
    # both steps are validated already (the space's and the config's), and setting eval_steps lifts no constraint
    evaluated = config.model_copy(update={"train": config.train.model_copy(update={"eval_steps": steps})})
    return evaluated, [f"train.eval_steps={steps}"]


def dimension(source: Path, name: str, spec: Any) -> Dimension:
    """One dimension of the space, checked: the field exists, the distribution fits its type, the bounds its range."""
    field = config_field(source, name)
    if not isinstance(spec, dict) or spec.get("distribution") not in DISTRIBUTIONS:
        raise ConfigError(f"{source}: {name}: expected {{distribution: one of {', '.join(DISTRIBUTIONS)}, ...}}, "
                          f"got {spec!r}")
    shape = spec["distribution"]
    extra = sorted(set(spec) - {"distribution", *SETTINGS[shape]})
    if extra:
        raise ConfigError(f"{source}: {name}: {extra[0]}: not a setting of a {shape} distribution; it takes: "
                          f"{', '.join(SETTINGS[shape])}")
    check_fits(source, name, field, shape)
    if shape == "categorical":
        return Dimension(field=name, distribution=shape, choices=checked_choices(source, name, field, spec))
    low, high = bounds(source, name, spec, whole=shape == "int")
    if shape == "log-uniform" and low <= 0:
        raise ConfigError(f"{source}: {name}: a log-uniform distribution needs low > 0 (got {low})")
    for side, value in (("low", low), ("high", high)):
        problem = rejected(field, int(value) if shape == "int" else value)
        if problem:
            raise ConfigError(f"{source}: {name}: {side} {value} is outside the field's allowed range ({problem})")
    step, log = spec.get("step", 1), spec.get("log", False)
    if not isinstance(step, int) or isinstance(step, bool) or step < 1 or not isinstance(log, bool):
        raise ConfigError(f"{source}: {name}: step must be a whole number >= 1 and log true or false "
                          f"(got step {step!r}, log {log!r})")
    return Dimension(field=name, distribution=shape, low=low, high=high, step=step, log=log)


def config_field(source: Path, name: str) -> FieldInfo:
    """The config model's field at a dotted path (YAML names: `validate`, `register`); a section or a placement
    field is not a dimension."""
    model: type[BaseModel] = PipelineConfig
    parts = name.split(".")
    for depth, part in enumerate(parts):
        found = next((info for attr, info in model.model_fields.items() if part in (attr, info.alias)), None)
        if found is None:
            where = ".".join(parts[:depth]) or "the config"
            allowed = ", ".join(info.alias or attr for attr, info in model.model_fields.items())
            raise ConfigError(f"{source}: {name}: unknown config field ({where} has: {allowed})")
        annotation = found.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if depth == len(parts) - 1:
                raise ConfigError(f"{source}: {name}: a section, not a field; name one of its fields")
            model = annotation
            continue
        if depth != len(parts) - 1:
            raise ConfigError(f"{source}: {name}: unknown config field ({'.'.join(parts[:depth + 1])} is a value, "
                              "not a section)")
        if is_placement(name) or is_unkeyed(name):
            raise ConfigError(f"{source}: {name}: says where things run, not what they make: not a dimension")
        return found
    raise ConfigError(f"{source}: {name!r}: not a config field")


def value_types(field: FieldInfo) -> set[type]:
    """The plain types a field's values take (bool apart from int; None dropped)."""
    annotation = field.annotation
    members = typing.get_args(annotation) if typing.get_origin(annotation) in (Union, types.UnionType) else (
        annotation,)
    found: set[type] = set()
    for member in members:
        if member is type(None):
            continue
        found.add(member if isinstance(member, type) else object)
    return found


def check_fits(source: Path, name: str, field: FieldInfo, shape: str) -> None:
    """A continuous distribution needs a float field; int needs an integer (or float) field; anything takes
    categorical."""
    taken = value_types(field)
    if shape in ("log-uniform", "uniform") and float not in taken:
        what = "takes whole numbers: use int or categorical" if int in taken else "is not a number: use categorical"
        raise ConfigError(f"{source}: {name}: {what}, not {shape}")
    if shape == "int" and not taken & {int, float}:
        raise ConfigError(f"{source}: {name}: is not a number: use categorical, not int")


def bounds(source: Path, name: str, spec: dict[str, Any], whole: bool) -> tuple[float, float]:
    low, high = spec.get("low"), spec.get("high")
    number = (int,) if whole else (int, float)
    if any(not isinstance(v, number) or isinstance(v, bool) for v in (low, high)):
        wanted = "whole numbers" if whole else "numbers"
        raise ConfigError(f"{source}: {name}: low and high must be {wanted} (got low {low!r}, high {high!r})")
    if not low < high:
        raise ConfigError(f"{source}: {name}: low must be below high (got low {low}, high {high})")
    return float(low), float(high)


def checked_choices(source: Path, name: str, field: FieldInfo, spec: dict[str, Any]) -> tuple[Choice, ...]:
    choices = spec.get("choices")
    if not isinstance(choices, list) or not choices:
        raise ConfigError(f"{source}: {name}: choices must be a non-empty list")
    for choice in choices:
        if not isinstance(choice, Choice):
            raise ConfigError(f"{source}: {name}: a choice must be a string, number, boolean or null "
                              f"(got {choice!r})")
        problem = rejected(field, choice)
        if problem:
            raise ConfigError(f"{source}: {name}: choice {choice!r} is not a value the field takes ({problem})")
    if len(set(map(json.dumps, choices))) < len(choices):
        raise ConfigError(f"{source}: {name}: choices repeat a value")
    return tuple(choices)


def rejected(field: FieldInfo, value: Any) -> str | None:
    """Why the field refuses the value (its type and constraints, as pydantic reads them), or None."""
    annotation = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
    adapter = TypeAdapter(annotation)
    try:
        adapter.validate_python(value, strict=isinstance(value, bool))
    except ValidationError as err:
        return err.errors()[0]["msg"].lower()
    return None


def is_unkeyed(path: str) -> bool:
    """A field no stage key covers (retries, rendezvous, checkpoint storage): trials differing in it would share one
    artifact and score the same."""
    return any(path == field or path.startswith(field + ".") for stage in STAGES for field in stage.unkeyed)
