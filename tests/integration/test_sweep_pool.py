"""Parallel sweep trials on a work pool: a real Prefect server, the deployments and limit of `llmops deploy
--gpu-limit 1`, one real process worker on `gpu` taking two runs at a time, and `llmops sweep --parallel 2` with
`launch.work_pool=gpu`. Both trials' training is sent at once as remote_stage flow runs; the pool's concurrency limit
lets one train at a time; both come back, scored, to one study."""

from __future__ import annotations

import subprocess
import textwrap
from datetime import datetime
from pathlib import Path

import httpx
import optuna
import pytest
from mlflow import MlflowClient

from llmops.data.synthetic import instruction_records
from llmops.io.files import write_jsonl
from tests.integration.stack import CLONE_CLI, pool_stack, run

pytestmark = [pytest.mark.integration, pytest.mark.slow]
SPACE = textwrap.dedent("""
    params:
      train.learning_rate: {distribution: log-uniform, low: 1.0e-3, high: 1.0e-2}
      train.warmup_ratio: {distribution: uniform, low: 0.0, high: 0.1}
    pruner: none
""")
SETTINGS = ["train.batch_size=8", "train.max_steps=6", "train.logging_steps=1", "tokenize.max_length=48",
            "evaluate.max_examples=4", "evaluate.max_new_tokens=4", "evaluate.primary_metric=completion_loss",
            "register.model_name=pooled"]


def training_spans(tracking_uri: str) -> list[tuple[int, int]]:
    """When each trial trained (its first and last logged loss, in ms), from the trials' MLflow runs: the worker
    logs into them while it holds the pool's slot."""
    client = MlflowClient(tracking_uri=tracking_uri)
    trials = client.search_runs([client.get_experiment_by_name("llmops").experiment_id],
                                "tags.`sweep.role` = 'trial'")
    spans = []
    for trial in trials:
        stamps = [point.timestamp for point in client.get_metric_history(trial.info.run_id, "train/loss")]
        spans.append((min(stamps), max(stamps)))
    return sorted(spans)


def test_parallel_trials_are_runs_on_the_work_pool_under_its_limit(tmp_path: Path) -> None:
    with pool_stack(tmp_path) as stack:
        write_jsonl(tmp_path / "d.jsonl", instruction_records(rows=160, seed=3))
        (tmp_path / "space.yaml").write_text(SPACE)
        run([*CLONE_CLI, "deploy", "--gpu-limit", "1"], stack.project, stack.sender_env)
        stack.start_worker("gpu", "--limit", "2")
        swept = subprocess.run([*CLONE_CLI, "sweep", "configs/tiny_sft_cpu.yaml", f"data.path={tmp_path / 'd.jsonl'}",
                                *SETTINGS, "launch.work_pool=gpu", f"workspace.remote={tmp_path / 'store'}",
                                "--space", str(tmp_path / "space.yaml"), "--trials", "2", "--parallel", "2"],
                               cwd=stack.project, env=stack.sender_env, capture_output=True, text=True, timeout=900)
        assert swept.returncode == 0, swept.stdout + swept.stderr
        body = {"flows": {"name": {"any_": ["remote_stage"]}}, "sort": "START_TIME_ASC"}
        sent = httpx.post(f"{stack.api}/flow_runs/filter", json=body, timeout=10).json()
        assert [(r["work_pool_name"], r["state_type"], r["parameters"]["stage"]) for r in sent] == [
            ("gpu", "COMPLETED", "train")] * 2
        # sent together (the second created before the first ended), trained one after the other (limit 1)
        assert datetime.fromisoformat(sent[1]["created"]) < datetime.fromisoformat(sent[0]["end_time"])
        first, second = training_spans(stack.base["MLFLOW_TRACKING_URI"])
        assert first[1] < second[0], (first, second)
        storage = f"sqlite:///{tmp_path / 'mlflow-studies.db'}"
        (summary,) = optuna.get_all_study_summaries(storage)
        trials = optuna.load_study(study_name=summary.study_name, storage=storage).get_trials()
        assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"]
        assert "registered pooled version 1" in swept.stdout
