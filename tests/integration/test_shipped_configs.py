"""Every config in configs/ runs from a fresh clone: `llmops data init` brings in its example data, and the whole
flow (ingest to register) runs it for a few steps."""

import os
import subprocess
from pathlib import Path

import pytest

from llmops.config.schema import PipelineConfig
from llmops.flows.pipeline import training_pipeline
from llmops.objectives import load_config
from tests.integration.stack import BIN, REPO, fresh_clone

pytestmark = [pytest.mark.integration, pytest.mark.slow]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
REGISTRY_PREFIX = "models:/"
# a few optimizer steps, a few held-out examples: this checks that a config runs, not what it learns
FEW_STEPS = ["train.max_steps=3", "train.logging_steps=1", "train.warmup_ratio=0", "evaluate.max_examples=8",
             "evaluate.max_new_tokens=4", "evaluate.batch_size=8"]
# rows (or completions) a step at most: a multiple of every shipped GRPO config's completions per prompt
MAX_BATCH = 32


def builds_on(config: PipelineConfig) -> str | None:
    """The registered model name a config starts from (`models:/NAME@alias`), if it does."""
    base = config.model.name_or_path or ""
    return base.removeprefix(REGISTRY_PREFIX).split("@")[0].split("/")[0] if base.startswith(REGISTRY_PREFIX) else None


def run_order(paths: list[Path]) -> list[Path]:
    """Configs that start from a registered version run after the ones that register it."""
    return sorted(paths, key=lambda path: builds_on(load_config(path)) is not None)


def overrides_for(config: PipelineConfig, base: Path, needed: set[str]) -> list[str]:
    """A hub model becomes a local one (this machine reaches no hub); a config that another one starts from trains
    until its gate can make it champion (judged on a loss, which a few dozen steps lower)."""
    extra = list(FEW_STEPS)
    if config.train.batch_size > MAX_BATCH:  # GRPO's 256 completions a step: a few steps need not sample that many
        extra.append(f"train.batch_size={MAX_BATCH}")
    name = config.model.name_or_path
    if name and not name.startswith(REGISTRY_PREFIX) and not (REPO / name).exists() and not Path(name).is_absolute():
        extra.append(f"model.name_or_path={base}")
    if config.registry.model_name in needed:
        extra += ["train.max_steps=40", "evaluate.primary_metric=completion_loss"]
    return extra


def test_every_shipped_config_runs_from_a_fresh_clone(tmp_path: Path, pretrained_base: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    clone = fresh_clone(tmp_path / "clone")
    env = {k: v for k, v in os.environ.items() if k != "LLMOPS_HOME"}
    init = subprocess.run([str(BIN / "llmops"), "data", "init"], cwd=clone, env=env, capture_output=True, text=True)
    assert init.returncode == 0, init.stdout + init.stderr
    monkeypatch.chdir(clone)
    monkeypatch.setenv("LLMOPS_HOME", str(clone / ".llmops"))
    configs = [clone / "configs" / path.name for path in run_order(CONFIGS)]
    needed = {name for name in (builds_on(load_config(path)) for path in configs) if name}
    registered = {}
    for path in configs:
        config = load_config(path)
        outcome = training_pipeline(str(path), overrides_for(config, pretrained_base, needed))
        # configs that read the same data share its data stages; every one trains its own model
        assert outcome["stages"]["train"] == "computed", (path.name, outcome["stages"])
        registration = outcome["registration"]
        registered[path.name] = (registration["model_name"], registration["version"], registration["alias"])
    assert sorted(registered) == sorted(path.name for path in CONFIGS)
    for name in needed:
        assert (name, "1", "champion") in registered.values(), f"{name} is not champion: {registered}"
