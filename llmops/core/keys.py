"""Stage keys: everything that shapes an artifact, hashed.

A key covers the config fields the stage reads (as the stage table declares them), the keys of
its upstream stages (so every upstream input and figure is covered, however deep), the files
outside the workspace it reads (data, a pretrained tokenizer or model, a template file), the
source of its module and of every project module that module imports, and the versions of the
libraries that shape its bytes. Because keys chain on keys, the whole plan is known before any
stage runs.
"""

from __future__ import annotations

import ast
import functools
import importlib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from llmops.core.stages import NAMES, WHOLE_CONFIG, Stage, stage
from llmops.core.workspace import hash_file, hash_json

PROJECT_PACKAGES = ("llmops",)


def read_fields(config: Any, paths: tuple[str, ...], unkeyed: tuple[str, ...] = ()) -> dict[str, Any]:
    """The values of dotted config paths, as JSON, without the unkeyed fields inside them; the whole config
    stands for its recipe (placement aside)."""
    # a read that is itself unkeyed (a section read only to find an input, e.g. the registry) is left out whole
    values = {path: config.recipe() if path == WHOLE_CONFIG else dump(lookup(config, path)) for path in paths
              if path not in unkeyed}
    for path, value in values.items():
        for skipped in unkeyed:
            if skipped.startswith(f"{path}.") or path == WHOLE_CONFIG:
                drop(value, skipped.removeprefix(f"{path}.") if path else skipped)
    return values


def drop(tree: Any, dotted: str) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        tree = tree.get(part) if isinstance(tree, dict) else None
    if isinstance(tree, dict):
        tree.pop(last, None)


def lookup(config: Any, path: str) -> Any:
    value = config
    for part in filter(None, path.split(".")):
        value = getattr(value, attribute_name(value, part))
    return value


def attribute_name(model: Any, name: str) -> str:
    """The Python attribute of a field given by its YAML name (`validate` is the alias of `validation`)."""
    fields = type(model).model_fields if isinstance(model, BaseModel) else {}
    return next((attr for attr, info in fields.items() if name in (attr, info.alias)), name)


def dump(value: Any) -> Any:
    if hasattr(value, "model_dump"):  # a config section (or a view of one)
        return value.model_dump(mode="json", by_alias=True)
    if isinstance(value, list | tuple):
        return [dump(item) for item in value]
    if isinstance(value, dict):
        return {key: dump(item) for key, item in value.items()}
    return value


def project_root_of_code() -> Path:
    return Path(__file__).resolve().parents[2]


@functools.cache
def code_files(module: str) -> tuple[Path, ...]:
    """The module's file and every project module it imports, directly or not (imports inside functions too)."""
    root = project_root_of_code()
    seen: dict[str, Path] = {}
    pending = [module]
    while pending:
        name = pending.pop()
        path = module_file(root, name)
        if path is None or name in seen:
            continue
        seen[name] = path
        pending.extend(imported_modules(path, name))
    return tuple(sorted(seen.values()))


def module_file(root: Path, name: str) -> Path | None:
    if name.split(".")[0] not in PROJECT_PACKAGES:
        return None
    base = root.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_modules(path: Path, name: str) -> list[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = resolve_relative(package, node.module, node.level)
            found.append(base)
            found.extend(f"{base}.{alias.name}" for alias in node.names)  # `from llmops.models import modeling`
    return found


def resolve_relative(package: str, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    parts = package.split(".")
    base = parts[: len(parts) - level + 1]
    return ".".join([*base, module] if module else base)


@functools.cache
def code_hash(module: str) -> str:
    root = project_root_of_code()
    return hash_json({path.relative_to(root).as_posix(): hash_file(path) for path in code_files(module)})


def library_versions(names: tuple[str, ...]) -> dict[str, str]:
    versions = {}
    for name in names:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = "absent"
    return versions


def inputs_of(spec: Stage, config: Any, root: Path) -> dict[str, Any]:
    """Fingerprints of what the stage reads from outside the workspace (data files, a base model)."""
    if spec.inputs is None:
        return {}
    module, _, name = spec.inputs.partition(":")
    return getattr(importlib.import_module(module), name)(config, root)


def stage_key(name: str, config: Any, upstream_keys: dict[str, str], inputs: dict[str, Any]) -> str:
    spec = stage(name)
    if set(upstream_keys) != set(spec.upstream):
        raise ValueError(f"stage {name} takes the records of {spec.upstream}, got {tuple(upstream_keys)}")
    material = {
        "stage": name,
        "reads": read_fields(config, spec.reads, spec.unkeyed),
        "upstream": upstream_keys,
        "inputs": inputs,
        "code": code_hash(spec.module),
        "libraries": library_versions(spec.libraries),
    }
    return hash_json(material)[:24]


def key_for(name: str, config: Any, upstream: list[Any], root: Path) -> str:
    """The key of a stage about to run on these upstream records."""
    return stage_key(name, config, {record.stage: record.key for record in upstream}, inputs_of(stage(name), config,
                                                                                                 root))


def plan(config: Any, root: Path) -> dict[str, str]:
    """Every stage's key for this config and these inputs, computed before anything runs."""
    keys: dict[str, str] = {}
    for name in NAMES:
        spec = stage(name)
        keys[name] = stage_key(name, config, {up: keys[up] for up in spec.upstream}, inputs_of(spec, config, root))
    return keys


def reads_whole_config(spec: Stage) -> bool:
    return WHOLE_CONFIG in spec.reads
