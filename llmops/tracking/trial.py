"""A sweep trial's link: where the train stage of a trial's pipeline run reports its evaluation loss.

It travels with the MLflow run handle of the trial's run, not in the config: it says where the run
belongs (the study's storage, its name, the trial's number), not what it makes, so no stage key
covers it. Kept apart from the space file's reading (pipeline/sweep.py), which no stage imports.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

# the trial's user attribute that records the step it was pruned at (set by training/pruning.py, read back by the
# sweep and its summary, also across machines)
PRUNED_AT = "pruned_at_step"


class TrialLink(BaseModel):
    """Where a trial's figures go while it trains: its study (in `storage`) and its number there."""

    model_config = ConfigDict(frozen=True)

    storage: str
    study: str
    trial: int
    # the study's pruner, as the sweep set it up (a loaded study gets Optuna's defaults otherwise)
    pruner: Literal["median", "none"] = "median"
    startup_trials: int = 5
