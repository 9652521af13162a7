"""Config fuzzing: whatever the overrides or the config file hold, `llmops` either accepts them or ends in one
line, exit code 2, with no traceback."""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from typer.testing import CliRunner

from llmops.core.config import PipelineConfig, load_config
from llmops.flows.cli import app

pytestmark = pytest.mark.reliability
REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "tiny_sft_cpu.yaml")
runner = CliRunner()
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


PATHS = leaf_paths(PipelineConfig) + ["data.path", "data.format", "data.columns", "data.columns.output",
                                      "data.sources.0.path", "train", "train.lr", "nosuch.key", "a.b.c.d.e"]
# values as a person might type them, and worse: YAML tags, unclosed brackets, NaN, huge numbers, odd text
ODD_VALUES = ["", "~", "null", ".nan", ".inf", "-.inf", "1e400", "9" * 400, "-1", "0", "[1, 2", "{a: b}", "{",
              "!!python/object/apply:os.system ['echo pwned']", "!!binary aGk=", "&a [*a]", "'unclosed", "\x00",
              "yes", "on", "2001-02-03", "0x1F", "[]", "{}", "../../etc/passwd", "a\nb", "true: false"]
values = st.one_of(st.sampled_from(ODD_VALUES), st.text(max_size=30), st.integers().map(str),
                   st.floats().map(str), st.lists(st.integers(), max_size=3).map(str))


def assert_accepted_or_one_line(result: Any) -> None:
    """Exit 0 with a config that loads again, or exit 2 with exactly one line that starts with `error:`."""
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    if result.exit_code == 0:
        return
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.output


@MORE
@given(overrides=st.lists(st.tuples(st.sampled_from(PATHS), values), min_size=1, max_size=3))
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
