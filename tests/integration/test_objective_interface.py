"""The objective interface carries the pipeline: an objective defined outside the package runs from ingest to
register, and a stage's key holds only the code it runs, so editing serving, registry or CLI code, or another
objective, retrains nothing."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from llmops.data.synthetic import instruction_records
from llmops.io.files import write_jsonl
from llmops.objectives import registry
from llmops.objectives.config import complete
from llmops.pipeline import keys
from llmops.pipeline.runner import planned
from llmops.tracking import log as mlflow_tracking
from tests.helpers import run_all_stages

pytestmark = pytest.mark.slow


def parity_rows(count: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    numbers = [rng.randint(0, 99999) for _ in range(count)]
    return [{"n": str(n), "label": "even" if n % 2 == 0 else "odd"} for n in numbers]


def test_an_objective_defined_outside_the_package_runs_from_ingest_to_register(tmp_path: Path) -> None:
    rows = parity_rows(1200, seed=3) + [{"n": "twelve", "label": "even"}, {"n": "7", "label": "prime"}]
    write_jsonl(tmp_path / "parity.jsonl", rows)
    config = complete({
        "data": {"path": str(tmp_path / "parity.jsonl"), "kind": "parity", "objective": "tests.toy_objective:Parity",
                 "eval_fraction": 0.1},
        "tokenize": {"vocab_size": 300, "max_length": 16},
        "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2},
        "train": {"epochs": 2, "batch_size": 32, "learning_rate": 3e-3, "logging_steps": 10},
        "evaluate": {"max_examples": 100}, "register": {"model_name": "toy-parity"}})
    assert registry.code_modules(config.data, "kind") == ("tests.toy_objective",)
    records = run_all_stages(config, "toy")
    validated = records["validate"].figures
    assert validated.rows_quarantined == 2 and validated.codes == {"wrong_type": 1, "label_unknown": 1}
    evaluated = records["evaluate"].figures
    assert evaluated.primary_metric == "accuracy"
    assert evaluated.metrics["trained"]["accuracy"] > 0.9 > evaluated.metrics["untrained"]["accuracy"] + 0.2
    registration = records["register"]
    assert registration.alias == "champion"
    version = mlflow_tracking.client(config.tracking).get_model_version("toy-parity", registration.version)
    assert version.tags["objective"] == "tests.toy_objective:Parity"
    assert "Parity: whether a number is even or odd" in version.description


def states(config: object) -> dict[str, str]:
    keys.code_files.cache_clear()
    keys.code_hash.cache_clear()
    return {name: state for name, _, state in planned(config)}


def test_editing_serving_registry_cli_or_another_objective_retrains_nothing(tmp_path: Path, copied_code: Path) -> None:
    write_jsonl(tmp_path / "instructions.jsonl", instruction_records(600, seed=5))
    config = complete({"data": {"path": str(tmp_path / "instructions.jsonl")},
                       "tokenize": {"vocab_size": 320, "max_length": 48},
                       "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2},
                       "train": {"max_steps": 5, "batch_size": 16}, "evaluate": {"max_examples": 10},
                       "register": {"model_name": "edits"}})
    run_all_stages(config, "before the edits")
    every_stage_reused = {**{name: "reused" for name in states(config)}, "register": "runs on every pipeline run"}
    assert states(config) == every_stage_reused
    for module in ("serving/predict.py", "registry/gate.py", "cli/app.py", "objectives/dpo.py",
                   "objectives/masked_lm.py", "data/synthetic.py"):
        with (copied_code / "llmops" / module).open("a") as handle:
            handle.write("\n\ndef added_later() -> None:\n    \"\"\"Unused.\"\"\"\n")
        assert states(config) == every_stage_reused, f"an edit of {module} would recompute a stage"
    with (copied_code / "llmops" / "objectives" / "sft.py").open("a") as handle:
        handle.write("\n# an edit of the selected objective\n")
    assert states(config) == {**every_stage_reused, "tokenize": "computed", "report": "computed",
                              "train": "computed", "evaluate": "computed"}
