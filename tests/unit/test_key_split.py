"""Keys hold what shapes an artifact and nothing else, as the layout in llmops/__init__.py declares it: keyed code
calls only keyed code, the config and the services (tests/integration/test_key_walk.py edits every module)."""

from __future__ import annotations

from pathlib import Path

from llmops import LAYERS, in_keys, layer_of
from llmops.pipeline import keys
from tests.sources import REPO, python_files

PACKAGE = REPO / "llmops"


def module_of(path: Path, root: Path = REPO) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_keyed_code_imports_only_keyed_code_the_config_and_the_services() -> None:
    """A module outside the keys is never run by one inside them, but for the config (its values are keyed) and
    the services (they move, record or schedule; the byte-identity test holds them to it)."""
    crossing = []
    for path in python_files("llmops"):
        name = module_of(path)
        if not in_keys(name):
            continue
        for imported in keys.imported_modules(path, name):
            there = layer_of(imported)
            if imported.startswith("llmops.") and there is not None and LAYERS[there].keys == "none":
                crossing.append(f"{name} imports {imported} ({there}: {LAYERS[there].holds})")
    assert not crossing, "\n".join(crossing)


def test_the_layout_names_every_package_and_keeps_the_services_below_the_keyed_stages() -> None:
    packages = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert packages == set(LAYERS)
    keyed_stages = min(LAYERS[name].rank for name in ("data", "training", "evaluation"))
    assert all(layer.rank < keyed_stages for layer in LAYERS.values() if layer.keys in ("service", "values"))
    assert all(layer.rank > LAYERS["evaluation"].rank for layer in LAYERS.values() if layer.keys == "none")
