"""Reading the config model: YAML files in configs/, `section.key=value` overrides, and one-line errors that name
the file (or the override) and the field at fault."""

from __future__ import annotations

import reprlib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from llmops.config.schema import MOVED, PipelineConfig
from llmops.io.errors import ConfigError


def read_raw(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """A YAML config as a mapping, with `section.key=value` overrides applied; not validated yet."""
    raw = read_yaml(Path(path))
    for override in overrides:
        apply_override(raw, override, path)
    return raw


def parse_config(raw: dict[str, Any], source: str | Path = "config",
                 overrides: list[str] | tuple[str, ...] = ()) -> PipelineConfig:
    """The config model of a mapping; a problem is one line naming the file (and the override) and the field. What
    the objective decides is checked by objectives/config.py, which every command loads configs through."""
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(describe_validation_error(err, source, overrides)) from None


def origin_of(source: str | Path, overrides: list[str] | tuple[str, ...], field: str) -> str:
    """Where a field's value came from: the file, or the override that set it."""
    origin = next((o for o in overrides if o.partition("=")[0].strip() == field), None)
    return f"{source} (override {origin})" if origin else str(source)


class UniqueKeys(yaml.SafeLoader):
    """The safe loader, with mappings that may not repeat a key: PyYAML keeps the last one without a word, so a
    config saying `kind: text` and later `kind: chat` in one section ran as chat."""


def unique_mapping(loader: UniqueKeys, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: keys given here override the merged ones
            continue
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, str | int | float | bool) or key is None:  # others: the base loader's own error
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} appears twice in one mapping",
                                                        key_node.start_mark)
            seen.add(key)
    return loader.construct_mapping(node, deep=deep)


UniqueKeys.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, unique_mapping)


def load_unique(text: str) -> Any:
    """One YAML document through the safe loader that refuses repeated keys."""
    loader = UniqueKeys(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"{path}: {'a folder, not a config file' if path.is_dir() else 'config file not found'}")
    try:
        raw = load_unique(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start})") from None
    except OSError as err:  # no permission to read it, a device that fails
        raise ConfigError(f"{path}: cannot read the config file ({err.strerror or err})") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a config") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{where} not valid YAML ({getattr(err, 'problem', err)})") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level, got {type(raw).__name__}")
    return raw


def apply_override(raw: dict[str, Any], override: str, path: str | Path) -> None:
    """Set `a.b.c=value` in the nested mapping; the value is read as a YAML scalar."""
    dotted, sep, value = override.partition("=")
    if not sep or not dotted.strip():
        raise ConfigError(f"override {override!r}: expected section.key=value")
    keys = dotted.strip().split(".")
    node = raw
    for depth, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            where = ".".join(keys[: depth + 1])
            raise ConfigError(f"{path}: override {override!r}: {where} is a value, not a section")
        node = child
    try:
        node[keys[-1]] = yaml.safe_load(value) if value.strip() else None
    except RecursionError:
        raise ConfigError(f"override {override!r}: the value is nested too deeply") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"override {override!r}: the value is not valid YAML ({getattr(err, 'problem', err)}); "
                          "quote it") from None


def describe_validation_error(err: ValidationError, path: str | Path, overrides: tuple[str, ...] | list[str]) -> str:
    first = err.errors()[0]
    loc = ".".join(str(part) for part in first["loc"])
    source = origin_of(path, overrides, loc)
    if first["type"] == "value_error" and not loc:  # a check across sections names its own fields
        message = f"{source}: {first['ctx']['error']}"
    elif first["type"] == "value_error" and isinstance(first.get("input"), dict):
        # a check across one section's fields: the section, not its whole input
        message = f"{source}: {loc}: {first['ctx']['error']}"
    elif first["type"] == "extra_forbidden" and loc in MOVED:
        # an override may set a field inside the moved key (train.rendezvous.node_rank=1): it is named
        inside = next((o.partition("=")[0].strip() for o in overrides if o.startswith(f"{loc}.")), loc)
        place = MOVED[loc] if "." in MOVED[loc] else f"{MOVED[loc]} (a section of its own)"
        message = f"{origin_of(path, overrides, inside)}: {loc}: moved to {place}"
    elif first["type"] == "extra_forbidden":
        allowed = allowed_keys(first["loc"][:-1])
        hint = f"; expected one of: {', '.join(allowed)}" if allowed else ""
        message = f"{source}: {loc}: unknown key{hint}"
    else:
        given = shown(first.get("input"))
        # a check of ours says what is wrong in its own words, without pydantic's "Value error, " before them
        reason = str(first["ctx"]["error"]) if first["type"] == "value_error" else first["msg"].lower()
        message = f"{source}: {loc}: {reason} (got {given})"
    more = len(err.errors()) - 1
    return message + (f" (and {more} more problem{'s' if more > 1 else ''})" if more else "")


def shown(value: Any) -> str:
    """A refused value as a message shows it: its repr, bounded in depth and items before it is cut to 200
    characters, since a value built of YAML aliases can hold 10^8 items while taking a few lines of the file."""
    bounded = reprlib.Repr()
    bounded.maxlevel, bounded.maxstring, bounded.maxother = 3, 200, 200
    bounded.maxlist = bounded.maxtuple = bounded.maxdict = bounded.maxset = 8
    given = bounded.repr(value)
    return given if len(given) <= 200 else given[:200] + "..."


def allowed_keys(loc: tuple[Any, ...]) -> list[str]:
    """The keys a section accepts, for the 'unknown key' message."""
    model: type[BaseModel] = PipelineConfig
    for part in loc:
        field = next((f for name, f in model.model_fields.items() if part in (name, f.alias)), None)
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return [f.alias or name for name, f in model.model_fields.items()]
