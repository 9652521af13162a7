"""`llmops sweep` through the real CLI: six trials on one tokenization, child runs under the study's run, median
pruning, the best trial registered through the gate, and a sweep killed by SIGKILL that resumes where it stopped."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import optuna
import pytest
from mlflow import MlflowClient

from llmops.data.synthetic import instruction_records
from llmops.io.files import write_jsonl
from tests.integration.stack import fresh_clone

pytestmark = [pytest.mark.integration, pytest.mark.slow]
BIN = Path(sys.executable).parent
# seconds-long trials: a few dozen rows, 16 steps evaluated every 4 (what the pruner reads), 8 held-out examples
SETTINGS = ["train.batch_size=8", "train.max_steps=16", "train.logging_steps=4", "tokenize.max_length=48",
            "evaluate.max_examples=8", "evaluate.max_new_tokens=8", "register.model_name=swept",
            # a few dozen steps lower the loss on the answers before they make exact matches: the gate judges that
            "evaluate.primary_metric=completion_loss"]
# two fields; the learning rates span slow to fast learning, so some trials fall behind the median early
SPACE = textwrap.dedent("""
    params:
      train.learning_rate: {distribution: log-uniform, low: 1.0e-4, high: 3.0e-2}
      train.lr_scheduler: {distribution: categorical, choices: [cosine, constant]}
    eval_steps: 4
    startup_trials: 2
""")
# loaded by the sweep's process: SIGKILL when trial KILL_TRIAL reports its first evaluation
KILLER = textwrap.dedent("""
    import os, signal
    trial = os.environ.get("KILL_TRIAL", "")
    if trial:
        from llmops.training import pruning
        original = pruning.PruningCallback.on_evaluate
        def on_evaluate(self, args, state, control, **kwargs):
            if self.link.trial == int(trial):
                os.kill(os.getpid(), signal.SIGKILL)
            return original(self, args, state, control, **kwargs)
        pruning.PruningCallback.on_evaluate = on_evaluate
""")


@pytest.fixture
def project(tmp_path: Path) -> dict[str, Path]:
    write_jsonl(tmp_path / "d.jsonl", instruction_records(rows=240, seed=31))
    (tmp_path / "space.yaml").write_text(SPACE)
    (tmp_path / "hooks").mkdir()
    (tmp_path / "hooks" / "sitecustomize.py").write_text(KILLER)
    (tmp_path / "clone").mkdir()
    return {"data": tmp_path / "d.jsonl", "space": tmp_path / "space.yaml", "home": tmp_path / "home",
            "hooks": tmp_path / "hooks", "clone": fresh_clone(tmp_path / "clone")}


def sweep(project: dict[str, Path], **extra: str) -> subprocess.CompletedProcess[str]:
    """The CLI of a copy of the project taken when the test started (so the killed sweep and the one that resumes
    it run the same code, and reach the same stage keys, whatever changes in this checkout meanwhile)."""
    command = [sys.executable, "-m", "llmops.cli.app", "sweep", "configs/tiny_sft_cpu.yaml",
               f"data.path={project['data']}", *SETTINGS, "--space", str(project["space"]), "--trials", "6"]
    code = [str(project["clone"]), str(project["hooks"])]
    environment = {**os.environ, "LLMOPS_HOME": str(project["home"]), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
                   "COLUMNS": "200", **extra,
                   "PYTHONPATH": os.pathsep.join(filter(None, [*code, os.environ.get("PYTHONPATH")]))}
    return subprocess.run(command, cwd=project["clone"], capture_output=True, text=True, env=environment,
                          timeout=900)


def test_a_sweep_prunes_registers_its_best_and_resumes_after_sigkill(project: dict[str, Path]) -> None:
    killed = sweep(project, KILL_TRIAL="3")
    assert killed.returncode == -9, killed.stdout + killed.stderr
    storage = f"sqlite:///{project['home'] / 'mlflow' / 'mlflow-studies.db'}"
    (summary,) = optuna.get_all_study_summaries(storage)
    study = optuna.load_study(study_name=summary.study_name, storage=storage)
    before = {t.number: t.state.name for t in study.get_trials()}
    assert before == {0: "COMPLETE", 1: "COMPLETE", 2: before[2], 3: "RUNNING"} and before[2] in ("COMPLETE", "PRUNED")

    resumed = sweep(project)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "trials 3 did not finish (their process was killed or stopped)" in resumed.stdout
    trials = study.get_trials()
    states = [t.state.name for t in trials]
    # the three finished before the kill kept; the killed one failed and asked again; six finished in all
    assert {t.number: t.state.name for t in trials[:3]} == {n: before[n] for n in range(3)}
    assert states[3] == "FAIL" and len(trials) == 7
    assert sum(state in ("COMPLETE", "PRUNED") for state in states) == 6
    retry = next(t for t in trials if t.user_attrs.get("retry_of") == 3)
    assert retry.params == trials[3].params
    pruned = [t for t in trials if t.state.name == "PRUNED"]
    assert pruned, f"no trial was pruned: {[(t.params, t.intermediate_values) for t in trials]}"
    assert all(t.user_attrs["pruned_at_step"] in t.intermediate_values for t in pruned)
    assert study.direction == optuna.study.StudyDirection.MINIMIZE  # completion loss

    uri = f"sqlite:///{project['home'] / 'mlflow' / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    experiment = client.get_experiment_by_name("llmops").experiment_id
    everything = client.search_runs([experiment])
    (parent,) = [run for run in everything if run.data.tags.get("sweep.role") == "study"]
    children = [run for run in everything if run.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    live = [run for run in children if run.info.status != "KILLED"]
    assert len(live) == 6 and all(run.info.status == "FINISHED" for run in live)
    (dead,) = [run for run in children if run.info.status == "KILLED"]  # the trial running at the kill
    assert dead.data.tags["sweep.trial"] == "3" and parent.info.status == "FINISHED"
    assert parent.data.tags["sweep.resumed"] == "1"
    # one tokenization: the study's run computed it, every trial reused it, one artifact
    assert [run.data.tags.get("stage.tokenize") for run in everything].count("computed") == 1
    assert {run.data.tags["stage.tokenize"] for run in live} == {"reused"}
    assert len([found for found in (project["home"] / "artifacts" / "tokenize").iterdir() if found.is_dir()]) == 1
    assert all(run.data.tags.get("stage.train") == "computed" for run in live if run.data.tags["sweep.state"] ==
               "complete")
    for run in live:
        state = run.data.tags["sweep.state"]
        assert state in ("complete", "pruned")
        assert ("sweep/value" in run.data.metrics) == (state == "complete")
        assert ("sweep.pruned_at_step" in run.data.tags) == (state == "pruned")
        assert float(run.data.params["train.learning_rate"]) > 0
    logged = {item.path for item in client.list_artifacts(parent.info.run_id, "sweep")}
    assert {"sweep/space.yaml", "sweep/trials.json", "sweep/optimization_history.png",
            "sweep/param_importances.png"} <= logged
    assert len(client.get_metric_history(parent.info.run_id, "sweep/completion_loss")) == 6 - len(pruned)

    # the best trial alone went through the gate, in its own run
    best = study.best_trial
    assert parent.data.tags["sweep.best_trial"] == str(best.number)
    (version,) = client.search_model_versions("name = 'swept'")
    assert version.run_id == best.user_attrs["mlflow_run_id"] == parent.data.tags["sweep.best_run"]
    assert client.get_model_version_by_alias("swept", "champion").version == version.version
    registered = [run for run in everything if run.data.tags.get("stage.register")]
    assert [run.info.run_id for run in registered] == [version.run_id]
    assert "registered swept version 1 → champion" in resumed.stdout
