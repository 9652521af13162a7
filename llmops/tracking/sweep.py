"""A sweep in MLflow: one parent run for the study, one child run per trial (a pipeline run of its own).

The parent run logs the space file, a row per trial (its parameters, state, primary metric and the
step it was pruned at) as a table and as metrics by trial number, the optimisation history and the
parameter importances as plots, and the best trial. A resumed sweep reopens the same parent run.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import tempfile
import warnings
from pathlib import Path
from typing import Any

from llmops.config.schema import PipelineConfig
from llmops.store.settings import mask
from llmops.tracking import log as tracking
from llmops.tracking import runs
from llmops.tracking.log import RunHandle
from llmops.tracking.trial import PRUNED_AT

log = logging.getLogger("llmops.sweep")
PARENT_RUN, TRIAL_RUN = "mlflow_parent_run", "mlflow_run_id"
PARENT_TAG = "mlflow.parentRunId"


def open_parent(config: PipelineConfig, study: Any, space_file: Path, storage: str, tags: dict[str, str]) -> RunHandle:
    """The study's parent run: the one it had (reopened: a resumed sweep), or a new one."""
    mlflow_client = tracking.client(config.tracking)
    previous = study.user_attrs.get(PARENT_RUN)
    if previous and exists(mlflow_client, previous):
        mlflow_client.update_run(previous, status="RUNNING")
        resumed = int(mlflow_client.get_run(previous).data.tags.get("sweep.resumed", "0")) + 1
        # this process owns it now: another run's orphan check must not close it
        tracking.set_tags(config.tracking, previous, {"llmops.host": socket.gethostname(),
                                                      "llmops.pid": str(os.getpid()), "sweep.resumed": str(resumed)})
        log.info("resuming sweep %s in MLflow run %s", study.study_name, previous)
        return RunHandle(tracking=config.tracking, run_id=previous)
    run_id = runs.start_run(config, f"sweep {study.study_name}", {
        **tags, "sweep.study": study.study_name, "sweep.storage": mask(storage), "sweep.role": "study"})
    study.set_user_attr(PARENT_RUN, run_id)
    run = RunHandle(tracking=config.tracking, run_id=run_id)
    tracking.log_file(run, space_file, "sweep")
    return run


def exists(mlflow_client: Any, run_id: str) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        return mlflow_client.get_run(run_id).info.lifecycle_stage == "active"
    except MlflowException:
        return False


def trial_tags(parent: RunHandle, study: str, number: int, tags: dict[str, str]) -> dict[str, str]:
    """A trial's pipeline run is a child of the study's run."""
    return {**tags, PARENT_TAG: parent.run_id, "sweep.study": study, "sweep.trial": str(number),
            "sweep.role": "trial"}


def record_trial(run: RunHandle, state: str, value: float | None, pruned_at: int | None) -> None:
    """The trial's outcome on its own run."""
    tags = {"sweep.state": state}
    if pruned_at is not None:
        tags["sweep.pruned_at_step"] = str(pruned_at)
    tracking.set_tags(run.tracking, run.run_id, tags)
    if value is not None and math.isfinite(value):
        tracking.log_metrics(run.tracking, run.run_id, {"sweep/value": value})


def trial_rows(study: Any) -> list[dict[str, Any]]:
    """One row per trial: number, state, the metric, the pruning step, its MLflow run, then its parameters."""
    rows = []
    for trial in study.get_trials(deepcopy=False):
        rows.append({"trial": trial.number, "state": trial.state.name.lower(),
                     # a pruned trial's value is only its last report: the metric is a completed trial's
                     "value": trial.value if trial.state.name == "COMPLETE" else None,
                     "pruned_at_step": trial.user_attrs.get(PRUNED_AT), "run_id": trial.user_attrs.get(TRIAL_RUN),
                     **{f"param.{name}": value for name, value in trial.params.items()}})
    return rows


def summarize(parent: RunHandle, study: Any, metric: str) -> list[dict[str, Any]]:
    """Log the study on its parent run: the trial table, per-trial metrics, the best trial, the two plots."""
    rows = trial_rows(study)
    tracking.log_table(parent, rows, "sweep/trials.json")
    for row in rows:
        figures = {f"sweep/{metric}": row["value"]} if isinstance(row["value"], float) else {}
        if row["pruned_at_step"] is not None:
            figures["sweep/pruned_at_step"] = float(row["pruned_at_step"])
        figures.update({f"sweep/param.{k[6:]}": float(v) for k, v in row.items()
                        if k.startswith("param.") and isinstance(v, int | float) and not isinstance(v, bool)})
        tracking.log_metrics(parent.tracking, parent.run_id, figures, step=row["trial"])
    counts = {state: sum(1 for row in rows if row["state"] == state) for state in ("complete", "pruned", "fail")}
    tags = {f"sweep.trials_{state}": str(count) for state, count in counts.items()}
    tags["sweep.metric"], tags["sweep.direction"] = metric, study.direction.name.lower()
    if counts["complete"]:
        best = study.best_trial
        tags.update({"sweep.best_trial": str(best.number), "sweep.best_value": f"{best.value:.6g}",
                     "sweep.best_run": best.user_attrs.get(TRIAL_RUN, "")})
    tracking.set_tags(parent.tracking, parent.run_id, tags)
    log_plots(parent, study)
    return rows


def log_plots(parent: RunHandle, study: Any) -> None:
    """Optuna's optimisation history and parameter importances as PNGs (importances need two finished trials whose
    parameters differ: until then there is none)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as plots

    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # optuna marks its matplotlib plots experimental
        for name, draw in (("optimization_history", plots.plot_optimization_history),
                           ("param_importances", plots.plot_param_importances)):
            try:
                axes = draw(study)
            except (ValueError, RuntimeError, ZeroDivisionError) as err:
                log.info("no %s plot yet: %s", name.replace("_", " "), err)
                continue
            figure = axes.figure if hasattr(axes, "figure") else axes.flat[0].figure
            path = Path(folder) / f"{name}.png"
            figure.savefig(path, dpi=100, bbox_inches="tight")
            plt.close(figure)
            tracking.log_file(parent, path, "sweep")


def close_parent(parent: RunHandle, error: BaseException | None) -> None:
    if error is None:
        runs.end_run(parent.tracking, parent.run_id, "FINISHED")
        return
    runs.record_failure(parent.tracking, parent.run_id, error,
                        "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED")
