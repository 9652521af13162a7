"""A sweep trial's training reports its evaluation loss to the trial's study, and stops when the study prunes it.

The trial's link (tracking/trial.py: storage, study, number) comes with the run handle, not the config,
so a trial trains under the same stage key as a plain run of its config. A pruned training raises
optuna's TrialPruned: its partial folder stays (a later run of the same config resumes it), and no
artifact is made of weights that stopped early.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

from llmops.tracking.trial import PRUNED_AT, TrialLink

log = logging.getLogger("llmops.train")


def open_trial(link: TrialLink) -> Any:
    """The running trial `link` names, as an optuna Trial of its study."""
    import optuna

    pruner = (optuna.pruners.MedianPruner(n_startup_trials=link.startup_trials, n_warmup_steps=0)
              if link.pruner == "median" else optuna.pruners.NopPruner())
    study = optuna.load_study(study_name=link.study, storage=link.storage, pruner=pruner)
    found = next((t for t in study.get_trials(deepcopy=False) if t.number == link.trial), None)
    if found is None:
        raise ValueError(f"study {link.study} has no trial {link.trial}")
    return optuna.trial.Trial(study, found._trial_id)


class PruningCallback(TrainerCallback):
    """Reports each evaluation loss to the trial (negated when the study maximizes: the pruner compares reported
    values in the study's direction) and raises TrialPruned when the study's pruner says so."""

    def __init__(self, link: TrialLink) -> None:
        import optuna

        self.link = link
        self.trial = open_trial(link)
        self.sign = -1.0 if self.trial.study.direction == optuna.study.StudyDirection.MAXIMIZE else 1.0

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: dict[str, float] | None = None,
                    **kwargs: Any) -> None:
        import optuna

        loss = (metrics or {}).get("eval_loss")
        if loss is None or not state.is_world_process_zero:
            return
        self.trial.report(self.sign * float(loss), state.global_step)
        if self.trial.should_prune():
            self.trial.set_user_attr(PRUNED_AT, int(state.global_step))
            log.info("trial %d of %s pruned at step %d (eval loss %.4f)", self.link.trial, self.link.study,
                     state.global_step, loss)
            raise optuna.TrialPruned(f"pruned at step {state.global_step} (eval loss {loss:.4g})")


def pruning_callbacks(link: TrialLink | None, world_size: int) -> list[TrainerCallback]:
    """The callback a sweep trial trains with; none outside a sweep, and none across processes, where one rank
    alone cannot stop the others (such a trial is scored, never pruned)."""
    if link is None:
        return []
    if world_size > 1:
        log.warning("trial %d of %s trains on %d processes: it reports nothing to the pruner and runs to the end",
                    link.trial, link.study, world_size)
        return []
    return [PruningCallback(link)]
