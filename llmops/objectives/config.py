"""Loading a config: the schema (config/schema.py), then what the selected objective adds and checks.

The objective fills in what it leaves to itself (DPO trains a LoRA adapter unless told otherwise;
`data.objective` names the objective chosen for the record kind), so the resolved config shows every
choice; then it checks what only it can judge: the record kind's label set and columns, the
architectures it builds, the metrics it reports.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmops.config.files import origin_of, parse_config, read_raw
from llmops.config.schema import PipelineConfig
from llmops.io.errors import ConfigError
from llmops.objectives import registry


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> PipelineConfig:
    """Read a YAML config, apply `section.key=value` overrides, validate it and complete it for its objective."""
    return complete(read_raw(path, overrides), path, overrides)


def complete(raw: dict[str, Any], source: str | Path = "config",
             overrides: list[str] | tuple[str, ...] = ()) -> PipelineConfig:
    """A raw config validated, completed with its objective's defaults and checked by it."""
    config = parse_config(raw, source, overrides)
    try:
        objective = registry.selected(config.data)
    except ConfigError as err:  # the message starts with the field at fault: data.kind or data.objective
        raise ConfigError(f"{origin_of(source, overrides, str(err).partition(':')[0])}: {err}") from None
    completed = objective.defaults(raw)
    data = {**(completed.get("data") or {}), "objective": registry_name(config)}
    config = parse_config({**completed, "data": data}, source, overrides)
    problems = objective.check(config)
    if problems:
        field, message = problems[0]
        more = len(problems) - 1
        tail = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
        raise ConfigError(f"{origin_of(source, overrides, field)}: {field}: {message}{tail}")
    return config


def registry_name(config: PipelineConfig) -> str:
    """The objective's name as data.objective spells it: a registry name, or the module:Class given."""
    if config.data.objective is not None:
        return config.data.objective
    target = registry.target_of(config.data)
    return next(entry.name for entry in registry.ENTRIES if entry.target == target)
