"""Keys hold what shapes an artifact and nothing else, as the layout in llmops/__init__.py declares it: keyed code
calls only keyed code, the config and the services; an edit of any keyed module recomputes exactly the stages that
run it and what follows them; an edit of any other module recomputes nothing."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmops import LAYERS, in_keys, layer_of
from llmops.data.synthetic import instruction_records
from llmops.flows.runner import plan
from llmops.io.files import write_jsonl
from llmops.objectives import registry
from llmops.objectives.config import complete
from llmops.pipeline import keys
from llmops.pipeline.stages import STAGES, downstream
from tests.sources import REPO, python_files

PACKAGE = REPO / "llmops"
# the modules the issue of keys was measured on: each only moves, records or schedules
NEVER_IN_A_KEY = ("tracking/log.py", "tracking/runs.py", "tracking/cost.py", "pipeline/engine.py",
                  "store/workspace.py", "store/artifacts.py", "store/shared.py", "config/schema.py",
                  "cli/render.py", "flows/runner.py", "registry/gate.py", "serving/predict.py")


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


@pytest.fixture
def copied_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A copy of the package whose files the keys hash: editing it changes keys, not the code that runs."""
    root = tmp_path / "code"
    shutil.copytree(PACKAGE, root / "llmops", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(keys, "project_root_of_code", lambda: root)
    keys.code_files.cache_clear()
    keys.code_hash.cache_clear()
    yield root
    keys.code_files.cache_clear()
    keys.code_hash.cache_clear()


def planned_keys(config: object, root: Path) -> dict[str, str]:
    keys.code_files.cache_clear()
    keys.code_hash.cache_clear()
    return plan(config, root)


@pytest.mark.slow  # plans the pipeline once for each of the package's modules
def test_every_module_edit_recomputes_exactly_what_it_can_shape(tmp_path: Path, copied_code: Path) -> None:
    """Walk every module of the package: append an unused function, plan again. Outside the keys nothing moves; a
    keyed module run by a stage moves that stage and every stage after it, and no other."""
    write_jsonl(tmp_path / "instructions.jsonl", instruction_records(40, seed=5))
    config = complete({"data": {"path": str(tmp_path / "instructions.jsonl")}, "register": {"model_name": "edits"}})
    before = planned_keys(config, tmp_path)
    runs = {spec.name: {module_of(path, copied_code) for path in keys.code_files(
        spec.module, *registry.code_modules(config.data, spec.objective_code))} for spec in STAGES}
    assert not {module for modules in runs.values() for module in modules if not in_keys(module)} - {
        spec.module for spec in STAGES}, "a stage's key holds a module the layout keeps out of keys"
    edited = 0
    for path in sorted((copied_code / "llmops").rglob("*.py")):
        name = module_of(path, copied_code)
        original = path.read_text()
        path.write_text(original + "\n\ndef added_later() -> None:\n    \"\"\"Unused.\"\"\"\n")
        changed = {stage for stage, key in planned_keys(config, tmp_path).items() if key != before[stage]}
        path.write_text(original)
        direct = {stage for stage, modules in runs.items() if name in modules}
        expected = direct | {after for stage in direct for after in downstream(stage)}
        assert changed == expected, f"an edit of {path.relative_to(copied_code)} recomputes {sorted(changed)}"
        assert in_keys(name) or name in {spec.module for spec in STAGES} or not changed
        edited += 1
    assert edited == len(python_files("llmops"))
    for module in NEVER_IN_A_KEY:
        assert not any(f"llmops.{module[:-3].replace('/', '.')}" in modules for modules in runs.values()), module
    assert planned_keys(config, tmp_path) == before
