"""`llmops sweep`: an Optuna study over config fields, each trial a pipeline run of its own config.

The data stages run first, once, under the config's keys: a trial whose space leaves them alone
finds every data artifact under the same key, so one tokenization serves every trial, and trains and
evaluates only. A trial's train stage reports its evaluation loss to the study as it trains
(training/pruning.py) and the study's median pruner may stop it; a pruned trial's run ends cleanly,
recorded as pruned. The register stage runs for no trial: when the study is done, the best trial
alone goes through the registry gate, in its own MLflow run. Trials run in `parallel` threads; a
train stage that goes to a work pool (`launch.work_pool`) runs there as a Prefect flow run, under
the pool's concurrency limit. Running the same command again resumes the study. The study itself
(storage, sampler, pruner, draws) is pipeline/sweep_study.py's, its MLflow runs tracking/sweep.py's.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

from llmops.config.schema import PipelineConfig
from llmops.data.lineage import source_tags
from llmops.flows.api import announce
from llmops.flows.remote import dispatch, work_pool
from llmops.io.errors import ConfigError, Interrupted
from llmops.io.files import project_root
from llmops.io.tables import table_rows
from llmops.objectives import load_config, selected
from llmops.pipeline import sweep_study
from llmops.pipeline.runner import log_stage, run_stage
from llmops.pipeline.stages import STAGES, downstream, stage
from llmops.pipeline.sweep import Space, read_space, with_evaluation
from llmops.tracking import log as tracking
from llmops.tracking import runs
from llmops.tracking import sweep as sweep_tracking
from llmops.tracking.log import RunHandle
from llmops.tracking.trial import TrialLink
from llmops.training.nonfinite import DivergedError

log = logging.getLogger("llmops.sweep")
REGISTER = "register"


@dataclass
class Sweep:
    """What one `llmops sweep` works with: the config as given, loaded and validated once (with the evaluation the
    pruner reads), the overrides that give it, and the space."""

    config_path: str
    overrides: list[str]
    config: PipelineConfig
    space: Space
    space_file: Path
    storage: str

    def trial_config(self, values: dict[str, Any]) -> PipelineConfig:
        return load_config(self.config_path, [*self.overrides, *sweep_study.overrides_of(values)])


@dataclass
class SweepResult:
    study: str
    storage: str
    parent_run: str
    metric: str
    direction: str
    rows: list[dict[str, Any]]
    ran: int
    reclaimed: list[int]
    best_trial: int | None = None
    registration: Any = None


def prepare(config_path: str, overrides: list[str], space_file: str, storage: str | None) -> Sweep:
    """The space, checked; the config with the evaluation the pruner reads; the study's database."""
    space = read_space(space_file)
    config, evaluation = with_evaluation(load_config(config_path, overrides), space)
    chosen = sweep_study.storage_url(config.tracking, storage)
    return Sweep(config_path, [*overrides, *evaluation], config, space, Path(space_file), chosen)


def run_sweep(sweep: Sweep, trials: int, parallel: int, name: str | None = None) -> SweepResult:
    """Run the study until `trials` trials have finished (completed or pruned), then register the best."""
    study, parent, metric, reclaimed, tags = start(sweep, trials, name)
    remaining = max(0, trials - sweep_study.finished(study))
    log.info("study %s: %d of %d trials finished, %d to run (%d at a time); %s %s", study.study_name,
             trials - remaining, trials, remaining, parallel, study.direction.name.lower(), metric)
    objective = TrialObjective(sweep, study.study_name, parent, metric, tags,
                               sweep_study.startup_trials(sweep.space, trials))
    result = SweepResult(study.study_name, sweep.storage, parent.run_id, metric, study.direction.name.lower(), [],
                         remaining, reclaimed)
    error: BaseException | None = None
    try:
        if remaining:
            # a trial whose training diverged fails (its run says why) and the study goes on to the others
            study.optimize(objective, n_trials=remaining, n_jobs=parallel, catch=(DivergedError,))
        if any(t.state.name == "COMPLETE" for t in study.get_trials(deepcopy=False)):
            result.best_trial = study.best_trial.number
            result.registration = register_best(sweep, study, parent)
        else:
            log.warning("no trial of study %s completed: nothing to register", study.study_name)
    except BaseException as err:
        error = err
        raise
    finally:
        result.rows = summarize_quietly(parent, study, metric)
        sweep_tracking.close_parent(parent, error)
    return result


def start(sweep: Sweep, trials: int, name: str | None) -> tuple[Any, RunHandle, str, list[int], dict[str, str]]:
    """The data stages built (or reused), the metric chosen, the study created or resumed with its parent run:
    (study, parent run, metric, trials reclaimed from a dead process, the runs' source tags)."""
    config = sweep.config
    announce(config)
    started = time.perf_counter()
    data = data_stages(config)
    metric, direction = primary_metric(config, data)
    storage = sweep_study.open_storage(sweep.storage)
    study = sweep_study.open_study(storage, name or sweep_study.study_name(config, sweep.space), sweep.space,
                                   direction, trials, config.train.seed)
    reclaimed = sweep_study.reclaim_stale(study)
    tags = source_tags(f"llmops sweep ({sweep.config_path})", project_root(), scheduled=False)
    fresh = sweep_tracking.PARENT_RUN not in study.user_attrs
    parent = sweep_tracking.open_parent(config, study, sweep.space_file, sweep.storage, tags)
    # the data stages belong to the study's run (its trials reuse them); a resumed sweep logs those it had to build
    # again (changed code or inputs), and leaves the record of the first build otherwise
    seconds = (time.perf_counter() - started) / max(len(data), 1)
    for record in data.values():
        if fresh or not record.reused:
            log_stage(stage(record.stage), parent, record, seconds)
    return study, parent, metric, reclaimed, tags


def summarize_quietly(parent: RunHandle, study: Any, metric: str) -> list[dict[str, Any]]:
    """The study's summary on its run; a failure to log it must not hide the sweep's own error."""
    try:
        return sweep_tracking.summarize(parent, study, metric)
    except Exception as err:  # the summary is a view: the trials themselves are in the study and their runs
        log.warning("the study's summary was not logged: %s", err)
        return sweep_tracking.trial_rows(study)


def data_stages(config: PipelineConfig) -> dict[str, Any]:
    """The stages before training (every stage that is neither train nor after it), built or reused once."""
    after = downstream("train") | {"train"}
    records: dict[str, Any] = {}
    for spec in STAGES:
        if spec.name not in after:
            records[spec.name] = run_stage(spec.name, config, [records[up] for up in spec.upstream])
    return records


def primary_metric(config: PipelineConfig, data: dict[str, Any]) -> tuple[str, str]:
    """The metric the study optimizes, chosen as evaluation will choose it (from the held-out rows), and whether
    to maximize or minimize it."""
    objective = selected(config.data)
    rows = [{k: v for k, v in row.items() if not k.startswith("_")}
            for row in islice(table_rows(data["dedup"].dir / "eval"), config.evaluate.max_examples)]
    metric, _ = objective.primary(config.evaluate.primary_metric, rows)
    return metric, "maximize" if objective.metrics[metric].higher_is_better else "minimize"


def trial_stages(config: PipelineConfig, run: RunHandle | None) -> dict[str, Any]:
    """A trial's pipeline run: every stage but register, each on a work pool when the config sends it to one."""
    skipped = {REGISTER} | downstream(REGISTER)
    records: dict[str, Any] = {}
    for spec in STAGES:
        if spec.name in skipped:
            continue
        upstream = [records[up] for up in spec.upstream]
        pool = work_pool(spec.name, config) if run is not None else None
        records[spec.name] = (dispatch(spec.name, pool, config, run, upstream) if pool else
                              run_stage(spec.name, config, upstream, run, list(records.values())))
    return records


class TrialObjective:
    """One trial: draw its values, run its pipeline in a child run, report its primary metric (or its pruning)."""

    def __init__(self, sweep: Sweep, study: str, parent: RunHandle, metric: str, tags: dict[str, str],
                 startup: int) -> None:
        self.sweep, self.study, self.parent, self.metric, self.tags = sweep, study, parent, metric, tags
        self.startup = startup

    def __call__(self, trial: Any) -> float:
        import optuna

        sweep_study.claim(trial)
        values = {dimension.field: sweep_study.suggest(trial, dimension) for dimension in self.sweep.space.params}
        config = self.sweep.trial_config(values)
        link = TrialLink(storage=self.sweep.storage, study=self.study, trial=trial.number,
                         pruner=self.sweep.space.pruner, startup_trials=self.startup)
        tags = sweep_tracking.trial_tags(self.parent, self.study, trial.number, self.tags)
        pruned_at, value = None, math.nan
        with runs.pipeline_run(config, f"{self.study}-trial-{trial.number}", tags) as run:
            trial.set_user_attr(sweep_tracking.TRIAL_RUN, run.run_id)
            try:
                records = trial_stages(config, run.model_copy(update={"trial": link}))
            except (KeyboardInterrupt, Interrupted):
                trial.set_user_attr(sweep_study.INTERRUPTED, True)  # asked again when the sweep resumes
                raise
            except Exception as err:
                pruned_at = sweep_study.pruned_step(trial, err)
                if pruned_at is None:
                    raise
                sweep_tracking.record_trial(run, "pruned", None, pruned_at)
                tracking.describe_run(run, f"trial {trial.number} of {self.study}: pruned at step {pruned_at}")
            else:
                value = self.value_of(records["evaluate"])
                sweep_tracking.record_trial(run, "complete", value, None)
                tracking.describe_run(run, f"trial {trial.number} of {self.study}: {self.metric} {value:.4g}")
        if pruned_at is not None:
            raise optuna.TrialPruned(f"pruned at step {pruned_at}")
        return value

    def value_of(self, evaluated: Any) -> float:
        figures = evaluated.figures
        if figures.primary_metric != self.metric:
            raise ConfigError(f"a trial's primary metric is {figures.primary_metric}, the study's {self.metric}: set "
                              "evaluate.primary_metric in the config, or keep the space off the fields that choose it")
        return float(figures.metrics["trained"][self.metric])


def register_best(sweep: Sweep, study: Any, parent: RunHandle) -> Any:
    """The best trial's model through the register stage and its gate, in the trial's own MLflow run (the version
    names that run: its config, metrics and figures); every other stage is reused."""
    best = study.best_trial
    config = sweep.trial_config(best.params)
    run = RunHandle(tracking=config.tracking, run_id=best.user_attrs[sweep_tracking.TRIAL_RUN])
    records = trial_stages(config, None)
    upstream = [records[name] for name in stage(REGISTER).upstream]
    registration = run_stage(REGISTER, config, upstream, run, list(records.values()))
    tracking.set_tags(parent.tracking, parent.run_id, {
        "registered_version": f"{registration.model_name}/{registration.version}",
        "register.alias": registration.alias or "none"})
    alias = registration.alias or "no alias"
    tracking.describe_run(parent, f"best: trial {best.number}, {registration.primary_metric} {best.value:.4g} → "
                                  f"{registration.model_name}/{registration.version} ({alias})")
    return registration
