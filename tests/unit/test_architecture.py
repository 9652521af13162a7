"""The architecture is checked, not hoped for: layers import only downward, no import cycles, dispatch on objectives
only inside objectives/, and modules a person can read whole."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

from llmops import LAYERS as LAYOUT
from llmops import layer_of
from tests.sources import REPO, python_files

# each layer imports only from the layers before it; packages of one rank (text, models) do not import each other
LAYERS: dict[str, int] = {name: layer.rank for name, layer in LAYOUT.items()}
MAX_LINES = 420
# what only objectives/ may compare with a string: the record kind, the objective, the registered task
DISPATCH_NAMES = {"kind", "objective", "task"}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in python_files("llmops")}


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The project modules a module imports, at the top or inside functions, by absolute or relative import."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            submodules = {f"{base}.{alias.name}" for alias in node.names} & known
            # `from package import module` imports the module; `from module import name`, the module
            found.update(submodules if len(submodules) == len(node.names) else {base, *submodules})
    return {module for module in found if module in known and module != name}


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(path, name, set(found)) for name, path in found.items()}


def layer(module: str) -> str | None:
    return layer_of(module)


def test_every_package_has_a_layer() -> None:
    packages = {layer(name) for name in modules()} - {None}
    assert packages == set(LAYERS), f"packages without a layer: {packages - set(LAYERS)}"


def test_layers_import_only_downward() -> None:
    upward = []
    for source, targets in graph().items():
        for target in targets:
            here, there = layer(source), layer(target)
            if here is None or there is None or here == there:
                continue
            if LAYERS[there] >= LAYERS[here]:
                upward.append(f"{source} -> {target} ({here} {LAYERS[here]} imports {there} {LAYERS[there]})")
    assert not upward, "imports that go up or sideways:\n" + "\n".join(sorted(upward))


def test_there_is_no_import_cycle() -> None:
    edges = graph()
    cycles = [component for component in strongly_connected(edges) if len(component) > 1]
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in cycles)


def strongly_connected(edges: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative: the components of mutually reachable modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    counter = 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    components.append(component)
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return components


def test_the_checks_find_a_cycle_and_an_upward_import() -> None:
    """The checks above can fail: a made-up graph with a cycle has a component of two."""
    assert {frozenset(c) for c in strongly_connected({"a": {"b"}, "b": {"a"}, "c": {"a"}}) if len(c) > 1} == \
        {frozenset({"a", "b"})}
    assert LAYERS["serving"] > LAYERS["registry"] > LAYERS["training"] > LAYERS["data"] > LAYERS["objectives"]


def dispatch_compares(path: Path) -> list[str]:
    """Comparisons of a kind, objective or task with a string literal (`kind == "chat"`, `task in ("a", "b")`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        named = any(isinstance(s, ast.Attribute) and s.attr in DISPATCH_NAMES or
                    isinstance(s, ast.Name) and s.id in DISPATCH_NAMES for s in sides)
        literal = any(isinstance(c, ast.Constant) and isinstance(c.value, str) for s in sides for c in ast.walk(s))
        if named and literal:
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_dispatch_on_objectives_lives_only_in_objectives() -> None:
    outside = [found for path in python_files("llmops") if "objectives" not in path.parts
               for found in dispatch_compares(path)]
    assert not outside, "objective dispatch outside objectives/:\n" + "\n".join(outside)


def test_the_dispatch_check_sees_a_kind_comparison(tmp_path: Path) -> None:
    sample = REPO / "tests" / ".dispatch_sample.py"
    sample.write_text('def f(config):\n    return config.data.kind == "chat"\n')
    try:
        assert dispatch_compares(sample)
    finally:
        sample.unlink()


@pytest.mark.parametrize("path", python_files("llmops"), ids=lambda p: str(p.relative_to(REPO)))
def test_modules_are_short_enough_to_read_whole(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= MAX_LINES, f"{path.relative_to(REPO)}: split it by what it does"


def test_one_top_level_package_is_installed() -> None:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["tool"]["setuptools"]["packages"]["find"]["include"] == ["llmops*"]
    assert project["project"]["scripts"]["llmops"] == "llmops.cli.app:main"
    assert not [p for p in REPO.iterdir() if p.is_dir() and (p / "__init__.py").is_file() and p.name not in
                ("llmops", "tests")]


def test_ignore_index_and_masking_are_defined_once() -> None:
    definitions: dict[str, list[str]] = defaultdict(list)
    for path in python_files("llmops"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name) and target.id == "IGNORE_INDEX":
                        definitions["IGNORE_INDEX"].append(str(path.relative_to(REPO)))
            if isinstance(node, ast.FunctionDef) and ("mask" in node.name and "secret" in node.name or
                                                      node.name in ("mask", "masked")):
                definitions["mask"].append(str(path.relative_to(REPO)))
    assert definitions == {"IGNORE_INDEX": ["llmops/text/encoding.py"], "mask": ["llmops/store/settings.py"]}
