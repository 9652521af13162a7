"""The sweep's study on a real SQLite storage: a trial's evaluation loss reaches the pruner in the study's direction,
a pruned trial records its step, and a trial left running by a dead process is failed and asked again."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest

from llmops.pipeline.sweep import Space
from llmops.pipeline.sweep_study import claim, finished, open_storage, open_study, reclaim_stale
from llmops.tracking.trial import PRUNED_AT, TrialLink
from llmops.training.pruning import PruningCallback, pruning_callbacks

SPACE = Space.model_validate({"params": [{"field": "train.learning_rate", "distribution": "log-uniform",
                                          "low": 1e-4, "high": 1e-2}], "startup_trials": 1})


def study_at(tmp_path: Path, direction: str) -> tuple[str, optuna.Study]:
    url = f"sqlite:///{tmp_path / 'studies.db'}"
    return url, open_study(open_storage(url), "s", SPACE, direction, trials=6, seed=0)


def evaluated(callback: PruningCallback, loss: float, step: int) -> None:
    state = SimpleNamespace(is_world_process_zero=True, global_step=step)
    callback.on_evaluate(None, state, None, metrics={"eval_loss": loss})


@pytest.mark.parametrize("direction", ["maximize", "minimize"])
def test_a_trial_worse_than_the_median_is_pruned_at_its_step(tmp_path: Path, direction: str) -> None:
    url, study = study_at(tmp_path, direction)
    sign = -1.0 if direction == "maximize" else 1.0
    first = study.ask()
    first.report(sign * 2.0, 4)
    study.tell(first, 0.5)
    good, bad = study.ask(), study.ask()
    evaluated(PruningCallback(TrialLink(storage=url, study="s", trial=good.number, startup_trials=1)), 1.0, 4)
    with pytest.raises(optuna.TrialPruned, match="pruned at step 4"):
        evaluated(PruningCallback(TrialLink(storage=url, study="s", trial=bad.number, startup_trials=1)), 3.0, 4)
    trials = {t.number: t for t in study.get_trials()}
    assert trials[good.number].intermediate_values == {4: sign * 1.0}
    assert PRUNED_AT not in trials[good.number].user_attrs
    assert trials[bad.number].intermediate_values == {4: sign * 3.0}
    assert trials[bad.number].user_attrs[PRUNED_AT] == 4


def test_no_pruning_outside_a_sweep_or_across_processes(tmp_path: Path) -> None:
    url, _ = study_at(tmp_path, "minimize")
    assert pruning_callbacks(None, 1) == []
    assert pruning_callbacks(TrialLink(storage=url, study="s", trial=0), 2) == []


def test_a_trial_left_running_by_a_dead_process_is_failed_and_asked_again(tmp_path: Path) -> None:
    _, study = study_at(tmp_path, "minimize")
    done = study.ask()
    done.suggest_float("train.learning_rate", 1e-4, 1e-2, log=True)
    study.tell(done, 1.0)
    orphan = study.ask()
    rate = orphan.suggest_float("train.learning_rate", 1e-4, 1e-2, log=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    claim(orphan)
    orphan.set_user_attr("pid", dead.pid)
    mine = study.ask()
    claim(mine)  # this live process's: left alone
    assert reclaim_stale(study) == [orphan.number]
    states = {t.number: t.state.name for t in study.get_trials()}
    assert states == {done.number: "COMPLETE", orphan.number: "FAIL", mine.number: "RUNNING", 3: "WAITING"}
    retry = study.ask()
    assert retry.number == 3 and retry.suggest_float("train.learning_rate", 1e-4, 1e-2, log=True) == rate
    assert study.get_trials()[3].user_attrs["retry_of"] == orphan.number
    assert finished(study) == 1


def test_a_trial_stopped_by_a_signal_is_asked_again_once(tmp_path: Path) -> None:
    _, study = study_at(tmp_path, "minimize")
    stopped = study.ask()
    rate = stopped.suggest_float("train.learning_rate", 1e-4, 1e-2, log=True)
    stopped.set_user_attr("interrupted", True)
    study.tell(stopped, state=optuna.trial.TrialState.FAIL)
    assert reclaim_stale(study) == [0]
    assert reclaim_stale(study) == []  # already asked again
    retry = study.ask()
    assert retry.suggest_float("train.learning_rate", 1e-4, 1e-2, log=True) == rate


def test_a_resumed_study_keeps_its_direction(tmp_path: Path) -> None:
    url, _ = study_at(tmp_path, "minimize")
    with pytest.raises(ValueError, match="study s minimizes its metric, this sweep would maximize it"):
        open_study(open_storage(url), "s", SPACE, "maximize", trials=6, seed=0)
