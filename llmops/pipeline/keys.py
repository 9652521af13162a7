"""Stage keys: everything that shapes an artifact, hashed.

A key covers the config fields the stage reads (as the stage table declares them), the keys of
its upstream stages (so every upstream input and figure is covered, however deep), the files
outside the workspace it reads (data, a pretrained tokenizer or model, a template file), the
source of the code it runs, and the versions of the libraries that shape its bytes. The code is
its module and every module of a keyed layer (llmops/__init__.py declares which) that it imports,
directly or not (imports inside functions too), plus the selected objective's module and what that
imports. Config code, the services (workspace, store, tracking, the worker pool) and everything
above evaluation never enter a key: editing them recomputes nothing. Objectives are imported by
name, so another objective's code is never part of a key. Because keys chain on keys, the whole plan is known
before any stage runs (pipeline/runner.py computes it).
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import threading
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from llmops import in_keys
from llmops.io.files import hash_file, hash_json
from llmops.pipeline.stages import WHOLE_CONFIG, Stage, stage

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
def code_files(*modules: str) -> tuple[Path, ...]:
    """The modules' files and every module of a keyed layer they import, directly or not (imports inside functions
    too). The walk goes through the config and the services, so that keyed code they call is hashed, but their own
    files are not: they do not shape bytes (llmops/__init__.py)."""
    root = project_root_of_code()
    seen: dict[str, Path] = {}
    visited: set[str] = set()
    pending = list(modules)
    while pending:
        name = pending.pop()
        if name in visited:
            continue
        visited.add(name)
        path = module_file(root, name) or (outside_file(name) if name in modules else None)
        if path is None:
            continue
        if name in modules or in_keys(name):
            seen[name] = path
        pending.extend(imported_modules(path, name))
    return tuple(sorted(seen.values()))


def outside_file(name: str) -> Path | None:
    """The file of a module outside the package named on purpose (an objective of your own, module:Class)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin and spec.origin.endswith(".py") else None


@functools.lru_cache(maxsize=8192)
def module_file(root: Path, name: str) -> Path | None:
    """The file of a project module under `root`; None for anything else (a name imported from a module, say).
    Remembered: a plan asks the same few hundred names stage after stage."""
    if name.split(".")[0] not in PROJECT_PACKAGES:
        return None
    base = root.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


# CPython 3.11 counts the AST's recursion depth per interpreter, not per thread: a parse while another thread parses
# can fail with "AST constructor recursion depth mismatch". Parses here take one lock and a failed one is tried again
# (the other parser may be a library's thread, which the lock does not hold back).
PARSE_LOCK = threading.Lock()
PARSE_ATTEMPTS = 3


def imported_modules(path: Path, name: str) -> list[str]:
    """What a module imports when it runs: every import, at the top or inside functions, but not the ones only a
    type checker reads (under `if TYPE_CHECKING:`)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    return list(imports_in(path.read_text(encoding="utf-8"), package))


@functools.lru_cache(maxsize=2048)
def imports_in(source: str, package: str) -> tuple[str, ...]:
    """The imports of a module's source (cached by content: every stage's key reads the same modules)."""
    found = []
    for node in runtime_nodes(parsed(source)):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = resolve_relative(package, node.module, node.level)
            found.append(base)
            found.extend(f"{base}.{alias.name}" for alias in node.names)  # `from llmops.models import modeling`
    return tuple(found)


def parsed(source: str, attempts: int = PARSE_ATTEMPTS) -> ast.Module:
    try:
        with PARSE_LOCK:
            return ast.parse(source)
    except SystemError:  # the race above, not the source: a syntax error is a SyntaxError
        if attempts <= 1:
            raise
        return parsed(source, attempts - 1)


def runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of the tree outside `if TYPE_CHECKING:` blocks."""
    found, pending = [], [tree]
    while pending:
        node = pending.pop()
        found.append(node)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            pending.extend(node.orelse)
            continue
        pending.extend(ast.iter_child_nodes(node))
    return found


def resolve_relative(package: str, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    parts = package.split(".")
    base = parts[: len(parts) - level + 1]
    return ".".join([*base, module] if module else base)


@functools.cache
def code_hash(*modules: str) -> str:
    root = project_root_of_code()
    return hash_json({(path.relative_to(root) if path.is_relative_to(root) else path).as_posix(): hash_file(path)
                      for path in code_files(*modules)})


def library_versions(names: tuple[str, ...]) -> dict[str, str]:
    return {name: library_version(name) for name in names}


@functools.cache
def library_version(name: str) -> str:
    """An installed package's version, looked up once a process: each lookup scans every folder on the path for
    package metadata (about 7 ms here), and a plan asks for it stage by stage."""
    try:
        return version(name)
    except PackageNotFoundError:
        return "absent"


def inputs_of(spec: Stage, config: Any, root: Path) -> dict[str, Any]:
    """Fingerprints of what the stage reads from outside the workspace (data files, a base model)."""
    if spec.inputs is None:
        return {}
    module, _, name = spec.inputs.partition(":")
    return getattr(importlib.import_module(module), name)(config, root)


def stage_key(name: str, config: Any, upstream_keys: dict[str, str], inputs: dict[str, Any],
              objective_modules: tuple[str, ...] = ()) -> str:
    """The key of stage `name`: its reads of `config`, its upstream keys, its inputs' fingerprints, its code (with
    the selected objective's modules it runs) and its libraries."""
    spec = stage(name)
    if set(upstream_keys) != set(spec.upstream):
        raise ValueError(f"stage {name} takes the records of {spec.upstream}, got {tuple(upstream_keys)}")
    material = {
        "stage": name,
        "reads": read_fields(config, spec.reads, spec.unkeyed),
        "upstream": upstream_keys,
        "inputs": inputs,
        "code": code_hash(spec.module, *objective_modules),
        "libraries": library_versions(spec.libraries),
    }
    return hash_json(material)[:24]


def reads_whole_config(spec: Stage) -> bool:
    return WHOLE_CONFIG in spec.reads
