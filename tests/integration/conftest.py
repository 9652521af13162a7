"""Fixtures of the integration tests: models that several test modules start from, trained once per test process."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmops.data.synthetic import instruction_records
from llmops.io.files import write_jsonl
from llmops.objectives import load_config
from llmops.pipeline import keys
from tests.helpers import run_all_stages, workspace_at

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def sft_registry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A workspace whose MLflow registry holds a tiny SFT model, `tiny-sft`, as champion: the registered starting
    point of the preference methods' tests (DPO, ORPO, KTO). Each test registers its own model names beside it."""
    root = tmp_path_factory.mktemp("sft")
    write_jsonl(root / "instructions.jsonl", instruction_records(1200, seed=11))
    with workspace_at(root / "home"):
        config = load_config(REPO / "configs" / "tiny_sft_cpu.yaml", [
            f"data.path={root / 'instructions.jsonl'}", "train.epochs=3", "evaluate.max_examples=20",
            "evaluate.primary_metric=completion_loss", "register.model_name=tiny-sft"])
        assert run_all_stages(config, "sft")["register"].alias == "champion"
    return root / "home"


@pytest.fixture
def sft_champion(sft_registry: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The registered SFT champion's URI; the test works in the workspace whose registry holds it."""
    monkeypatch.setenv("LLMOPS_HOME", str(sft_registry))
    return "models:/tiny-sft@champion"


@pytest.fixture
def copied_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A copy of the package whose files the keys hash: editing it changes keys, not the code that runs."""
    root = tmp_path / "code"
    shutil.copytree(REPO / "llmops", root / "llmops", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(keys, "project_root_of_code", lambda: root)
    keys.code_files.cache_clear()
    keys.code_hash.cache_clear()
    yield root
    keys.code_files.cache_clear()
    keys.code_hash.cache_clear()
