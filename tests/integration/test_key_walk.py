"""Never stale, never too eager: every module of the package, edited, recomputes exactly the stages whose keys hold
it (as the layout in llmops/__init__.py decides) and the stages after them; a module outside the keys, nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmops import in_keys
from llmops.data.synthetic import instruction_records
from llmops.io.files import write_jsonl
from llmops.objectives import registry
from llmops.objectives.config import complete
from llmops.pipeline import keys
from llmops.pipeline.runner import plan
from llmops.pipeline.stages import STAGES, downstream
from tests.sources import REPO, python_files

PACKAGE = REPO / "llmops"
# the modules the issue of keys was measured on: each only moves, records or schedules
NEVER_IN_A_KEY = ("tracking/log.py", "tracking/runs.py", "tracking/cost.py", "pipeline/engine.py",
                  "store/workspace.py", "store/artifacts.py", "store/shared.py", "config/schema.py",
                  "cli/render.py", "pipeline/runner.py", "registry/gate.py", "serving/predict.py")


def module_of(path: Path, root: Path = REPO) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


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
