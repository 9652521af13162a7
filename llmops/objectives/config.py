"""Loading a config: the schema (config/schema.py), then what the selected objective adds and checks.

The objective fills in what it leaves to itself (DPO trains a LoRA adapter unless told otherwise;
`data.objective` names the objective chosen for the record kind), so the resolved config shows every
choice; then it checks what only it can judge: the record kind's label set and columns, the
architectures it builds, the metrics it reports.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from llmops.config.files import origin_of, parse_config, read_raw
from llmops.config.schema import OBJECTIVE_SECTIONS, DataConfig, PipelineConfig
from llmops.io.errors import ConfigError
from llmops.objectives import registry

if TYPE_CHECKING:  # an annotation only: the stages whose keys walk this module's imports hold no model code
    from llmops.objectives.base import Objective

# configs handed on by the code that loaded them, by the file and overrides they were loaded from (see `handing`)
HANDED: dict[tuple[str, tuple[str, ...]], PipelineConfig] = {}


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> PipelineConfig:
    """Read a YAML config, apply `section.key=value` overrides, validate it and complete it for its objective; a
    config handed on for this file and these overrides (`handing`) is taken as it is, not read again."""
    handed = HANDED.get(handed_key(path, overrides))
    if handed is not None:
        return handed
    return complete(read_raw(path, overrides), path, overrides)


@contextmanager
def handing(config: PipelineConfig, path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Iterator[None]:
    """Within the block, loading `path` with `overrides` gives `config`, already validated: a command hands its
    config to the flow it starts, whose parameters stay the path and overrides (all a deployment run has, and
    nothing a person would not want recorded, unlike a whole config with its URIs), without a second parse."""
    key = handed_key(path, overrides)
    before = HANDED.get(key)
    HANDED[key] = config
    try:
        yield
    finally:
        if before is None:
            HANDED.pop(key, None)
        else:
            HANDED[key] = before


def handed_key(path: str | Path, overrides: list[str] | tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    return str(Path(path).resolve()), tuple(overrides)


def complete(raw: dict[str, Any], source: str | Path = "config",
             overrides: list[str] | tuple[str, ...] = ()) -> PipelineConfig:
    """A raw config validated, completed with its objective's defaults and checked by it."""
    selecting = data_section(raw, source, overrides)
    try:
        objective = registry.selected(selecting)
    except ConfigError as err:  # the message starts with the field at fault: data.kind or data.objective
        raise ConfigError(f"{origin_of(source, overrides, str(err).partition(':')[0])}: {err}") from None
    completed = objective.defaults(raw)
    config = parse_config({**completed, "data": completed_data(raw, completed, selecting, source, overrides)},
                          source, overrides)
    refuse_unread_sections(config, objective, source, overrides)
    problems = objective.check(config)
    if problems:
        field, message = problems[0]
        more = len(problems) - 1
        tail = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
        raise ConfigError(f"{origin_of(source, overrides, field)}: {field}: {message}{tail}")
    return config


def refuse_unread_sections(config: PipelineConfig, objective: Objective, source: str | Path,
                           overrides: list[str] | tuple[str, ...]) -> None:
    """Another objective's section, set away from its defaults, would train nothing and change the stage keys: a
    config error naming the section and the objectives that read it. Holding its defaults (as a resolved config
    written out does), it passes."""
    for name in OBJECTIVE_SECTIONS:
        if name == objective.section or getattr(config, name) == PipelineConfig.model_fields[name].get_default(
                call_default_factory=True):
            continue
        readers = registry.section_readers(name)
        who = f"only objectives {', '.join(readers[:-1])} and {readers[-1]} read" if len(readers) > 1 else \
            f"only objective {readers[0]} reads"
        setting = next((key for key in (o.partition("=")[0].strip() for o in overrides)
                        if key == name or key.startswith(f"{name}.")), name)
        raise ConfigError(f"{origin_of(source, overrides, setting)}: {name}: {who} this section; this config trains "
                          f"{objective.name}")


def data_section(raw: dict[str, Any], source: str | Path, overrides: list[str] | tuple[str, ...]) -> DataConfig:
    """The data section alone, which selects the objective: the whole config is parsed once, with the objective's
    defaults in; a section that does not parse is reported as the whole config's parse reports it."""
    try:
        return DataConfig.model_validate(raw.get("data") or {})
    except (ValidationError, AttributeError) as err:
        parse_config(raw, source, overrides)  # the one-line error naming the file and field
        raise ConfigError(f"{source}: data: {err}".splitlines()[0]) from None


def completed_data(raw: dict[str, Any], completed: dict[str, Any], selecting: DataConfig, source: str | Path,
                   overrides: list[str] | tuple[str, ...]) -> DataConfig:
    """The data section with the objective's name in it: the section parsed to select the objective, unless the
    objective's defaults changed it (the whole config's parse takes a parsed section as it is, so it is parsed
    once)."""
    named = {"objective": registry_name(selecting)}
    if completed.get("data") is raw.get("data"):
        return selecting.model_copy(update=named)
    return data_section({**completed, "data": {**(completed.get("data") or {}), **named}}, source, overrides)


def registry_name(data: DataConfig) -> str:
    """The objective's name as data.objective spells it: a registry name, or the module:Class given."""
    if data.objective is not None:
        return data.objective
    target = registry.target_of(data)
    return next(entry.name for entry in registry.ENTRIES if entry.target == target)
