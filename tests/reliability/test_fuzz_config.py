"""Config fuzzing: whatever the overrides or the config file hold, `llmops` either accepts them or ends in one
line, exit code 2, with no traceback."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any, get_args
from unittest import mock

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from typer.main import get_command
from typer.testing import CliRunner, Result

from llmops.cli.app import app
from llmops.config.schema import PipelineConfig
from llmops.objectives import load_config, registry
from llmops.objectives.metrics import directed

pytestmark = pytest.mark.reliability
REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "tiny_sft_cpu.yaml")


@cache
def command() -> Any:  # the click command Typer builds
    return get_command(app)


class OneBuildRunner(CliRunner):
    """Typer's test runner with the app's click command built once: Typer builds it again on every invoke, which
    was most of a call's time in these thousand calls."""

    def invoke(self, *args: Any, **kwargs: Any) -> Result:
        with mock.patch("typer.testing._get_command", lambda _: command()):
            return super().invoke(*args, **kwargs)


runner = OneBuildRunner()
# a config example costs milliseconds: five times the profile's examples
MORE = settings(max_examples=5 * settings.default.max_examples)


def leaf_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted path the config model has, sections included."""
    paths = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{field.alias or name}"
        paths.append(path)
        nested = next((t for t in (field.annotation, *get_args(field.annotation))
                       if isinstance(t, type) and issubclass(t, BaseModel)), None)
        if nested is not None:
            paths += leaf_paths(nested, f"{path}.")
    return paths


# what the objective registry checks is a plain string in the model: its names, which a generated string would
# almost never hit, are drawn from the registry and the objectives' metric tables
OBJECTIVES = {entry.name: registry.objective_class(entry.target) for entry in registry.ENTRIES}
METRICS = sorted({name for objective in OBJECTIVES.values() for name in objective.metrics})
NAMED = {"data.kind": registry.record_kinds(), "data.objective": registry.names(),
         "evaluate.primary_metric": METRICS}
# names the registry must refuse in one line: near misses, and module:Class paths that are no objective or no module
NOT_NAMED = ["Text", "SFT", "images", "causal-lm", ":x", ".relative:Class", "os:system", "no.such.module:Thing",
             "llmops.objectives.sft:NoSuch", "llmops.records.base:TextRecords", "a:b:c"]
PATHS = leaf_paths(PipelineConfig) + ["data.path", "data.format", "data.columns", "data.columns.output",
                                      "data.sources.0.path", "train", "train.lr", "nosuch.key", "a.b.c.d.e",
                                      *(f"register.guards.{name}" for name in [*METRICS, "nosuch"])]
# values as a person might type them, and worse: YAML tags, unclosed brackets, NaN, huge numbers, odd text
ODD_VALUES = ["", "~", "null", ".nan", ".inf", "-.inf", "1e400", "9" * 400, "-1", "0", "[1, 2", "{a: b}", "{",
              "!!python/object/apply:os.system ['echo pwned']", "!!binary aGk=", "&a [*a]", "'unclosed", "\x00",
              "yes", "on", "2001-02-03", "0x1F", "[]", "{}", "../../etc/passwd", "a\nb", "true: false"]
values = st.one_of(st.sampled_from(ODD_VALUES), st.text(max_size=30), st.integers().map(str),
                   st.floats().map(str), st.lists(st.integers(), max_size=3).map(str))


def values_for(path: str) -> st.SearchStrategy[str]:
    """Any value, and for a field the registry checks, also the names it knows and near misses."""
    if path in NAMED:
        return st.one_of(st.sampled_from(NAMED[path]), st.sampled_from(NOT_NAMED), values)
    if path == "register.guards":
        return st.one_of(st.sampled_from(METRICS + NOT_NAMED).map(lambda name: f'{{"{name}": 0.1}}'), values)
    return values


overrides_strategy = st.lists(st.sampled_from(PATHS).flatmap(lambda path: st.tuples(st.just(path), values_for(path))),
                              min_size=1, max_size=3)


def assert_accepted_or_one_line(result: Any) -> None:
    """Exit 0 with a config that loads again, or exit 2 with exactly one line that starts with `error:`."""
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    if result.exit_code == 0:
        return
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.output


@MORE
@given(overrides=overrides_strategy)
def test_any_override(overrides: list[tuple[str, str]], tmp_path: Path) -> None:
    args = [f"{path}={value}" for path, value in overrides]
    result = runner.invoke(app, ["config", CONFIG, *args])
    assert_accepted_or_one_line(result)
    if result.exit_code == 0:  # what was accepted is a config that loads again, to the same thing
        written = tmp_path / "resolved.yaml"
        written.write_text(result.stdout)
        assert load_config(written) == load_config(CONFIG, args)


section_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=12)),
                              lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                         max_size=3), max_leaves=8)
sections = st.dictionaries(st.sampled_from([p for p in PATHS if "." not in p] + ["extra"]),
                           st.one_of(section_values, st.dictionaries(
                               st.sampled_from([p.split(".")[-1] for p in PATHS]), section_values, max_size=4)),
                           max_size=4)


@MORE
@given(document=st.one_of(sections, section_values))
def test_any_config_file(document: Any, tmp_path: Path) -> None:
    path = tmp_path / "fuzzed.yaml"
    path.write_text(yaml.safe_dump(document))
    assert_accepted_or_one_line(runner.invoke(app, ["config", str(path)]))


@MORE
@given(content=st.binary(max_size=200))
def test_any_bytes_as_a_config_file(content: bytes, tmp_path: Path) -> None:
    path = tmp_path / "bytes.yaml"
    path.write_bytes(content)
    assert_accepted_or_one_line(runner.invoke(app, ["config", str(path)]))


def test_wrong_values_reach_the_run_command_as_one_line() -> None:
    """`llmops run` reads the config the same way, before any work starts."""
    for override in ("train.learning_rate=.nan", "register.model_name=../../escape", "data.columns={outptu: x}",
                     "train.batch_size=[1", "validate.max_bad_fraction=2"):
        result = runner.invoke(app, ["run", CONFIG, override])
        assert_accepted_or_one_line(result)
        assert result.exit_code == 2, override


def config_of(objective: str) -> str:
    """A shipped config that trains this objective (every objective ships one)."""
    found = next((path for path in sorted((REPO / "configs").glob("*.yaml"))
                  if load_config(path).data.objective == objective), None)
    assert found is not None, f"no config in configs/ trains objective {objective}"
    return str(found)


def test_every_kind_and_objective_is_accepted_or_refused_in_one_line() -> None:
    """Each record kind with each objective, as overrides of each objective's config: a pair the objective trains on
    loads, any other pair is one line naming what to set."""
    for objective in OBJECTIVES:
        config = config_of(objective)
        assert load_config(config).data.objective == objective
        for kind in registry.record_kinds():
            for other in registry.names():
                result = runner.invoke(app, ["config", config, f"data.kind={kind}", f"data.objective={other}"])
                assert_accepted_or_one_line(result)
                if kind not in {k.name for k in OBJECTIVES[other].kinds}:
                    assert result.exit_code == 2 and "data.kind" in result.output, (kind, other, result.output)
        for name in NOT_NAMED:
            result = runner.invoke(app, ["config", config, f"data.objective={name}"])
            assert_accepted_or_one_line(result)
            assert result.exit_code == 2 and "data.objective" in result.output, (name, result.output)
            result = runner.invoke(app, ["config", config, f"data.kind={name}", "data.objective=null"])
            assert_accepted_or_one_line(result)
            assert result.exit_code == 2 and "expected one of: " + ", ".join(registry.record_kinds()) in result.output


def test_metric_names_are_the_objectives_own() -> None:
    """A primary metric or a guard is accepted when the objective reports it with a better direction; any other
    name is one line listing the ones it reports."""
    for objective, cls in OBJECTIVES.items():
        config = config_of(objective)
        allowed = directed(cls.metrics)
        for name in [*METRICS, *NOT_NAMED]:
            for override in (f"evaluate.primary_metric={name}", f'register.guards={{"{name}": 0.1}}'):
                result = runner.invoke(app, ["config", config, override])
                assert_accepted_or_one_line(result)
                if name in allowed:
                    assert result.exit_code == 0, (objective, override, result.output)
                    assert load_config(config, [override]) is not None
                else:
                    assert result.exit_code == 2, (objective, override)
                    assert f"expected one of: {', '.join(allowed)}" in result.output, result.output
