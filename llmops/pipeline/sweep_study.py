"""A sweep's Optuna study: where it is stored, how it samples and prunes, what a trial draws, and its resume.

The study lives beside the tracking store: MLflow's SQLite file gets a sibling file
(`mlflow.db` → `mlflow-studies.db`), a PostgreSQL or MySQL store a sibling database (`mlflow` →
`mlflow_studies`), which must exist. Not in the same database: MLflow and Optuna both keep their
schema's revision in an alembic `alembic_version` table, and each refuses the other's revision
there (Optuna: "no longer compatible with the table schema"; MLflow: "Can't locate revision").
Their other tables do not collide, but one table is enough. A tracking server (http) does not say
where its database is: `--storage` names it.

A trial records the host and process that run it; a trial left running by a process that is gone
(killed) is marked failed when the sweep runs again, and its parameters are asked again, as are those
of a trial stopped by Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from llmops.config.schema import PipelineConfig, TrackingConfig
from llmops.io.errors import ConfigError, UserError
from llmops.pipeline.sweep import Dimension, Space
from llmops.store import settings
from llmops.tracking.runs import alive
from llmops.tracking.trial import PRUNED_AT

log = logging.getLogger("llmops.sweep")
HOST, PID, RETRY_OF, INTERRUPTED = "host", "pid", "retry_of", "interrupted"
# the trial states that count towards --trials
FINISHED = ("COMPLETE", "PRUNED")


class StudyStorageError(UserError, RuntimeError):
    """The study's database cannot be opened."""


def storage_url(tracking: TrackingConfig, given: str | None) -> str:
    """The study's database: `given`, else the sibling of the tracking store's database."""
    if given:
        return given
    uri = settings.tracking_uri(tracking)
    parts = urlsplit(uri)
    scheme = parts.scheme.partition("+")[0]
    if scheme == "sqlite":
        head, _, name = uri.rpartition("/")
        stem, dot, suffix = name.rpartition(".")
        return f"{head}/{stem or suffix}-studies{dot}{suffix if stem else ''}"
    if scheme in ("postgresql", "postgres", "mysql", "mssql"):
        database = parts.path.lstrip("/") or "mlflow"
        return urlunsplit(parts._replace(path=f"/{database}_studies"))
    raise ConfigError(f"MLflow tracking at {settings.mask(uri)} is not a database this command can find: pass "
                      "--storage with the SQL database the study lives in (e.g. the team's postgresql://.../studies)")


def open_storage(url: str) -> Any:
    """Optuna's SQL storage at `url` (SQLite waits for a lock rather than failing at once: trials write in threads)."""
    import optuna
    from sqlalchemy.exc import SQLAlchemyError

    engine = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
    try:
        return optuna.storages.RDBStorage(url, engine_kwargs=engine)
    except (SQLAlchemyError, RuntimeError, ValueError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise StudyStorageError(f"the study's database {settings.mask(url)} cannot be opened ({settings.mask(first)}); "
                                "create it, or name another with --storage") from None


def study_name(config: PipelineConfig, space: Space) -> str:
    """The same config and space name the same study, so running the same command again resumes it."""
    import hashlib

    digest = hashlib.sha256(f"{config.digest()}:{space.digest()}".encode()).hexdigest()
    return f"{config.registry.model_name}-sweep-{digest[:10]}"


def startup_trials(space: Space, trials: int) -> int:
    """Trials sampled at random (TPE) and finished (the pruner) before either acts on what earlier trials did."""
    return space.startup_trials or max(1, min(5, trials // 3))


def open_study(storage: Any, name: str, space: Space, direction: str, trials: int, seed: int) -> Any:
    """The study, created or loaded; its sampler seeded by how many trials it has, so a resumed study does not draw
    its first trials' parameters again."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    existing = next((s for s in storage.get_all_studies() if s.study_name == name), None)
    drawn = len(storage.get_all_trials(existing._study_id, deepcopy=False)) if existing else 0
    startup = startup_trials(space, trials)
    sampler = (optuna.samplers.TPESampler(seed=seed + drawn, n_startup_trials=startup) if space.sampler == "tpe"
               else optuna.samplers.RandomSampler(seed=seed + drawn))
    pruner = (optuna.pruners.MedianPruner(n_startup_trials=startup, n_warmup_steps=0) if space.pruner == "median"
              else optuna.pruners.NopPruner())
    study = optuna.create_study(storage=storage, study_name=name, direction=direction, sampler=sampler,
                                pruner=pruner, load_if_exists=True)
    if study.direction.name.lower() != direction:
        raise ConfigError(f"study {name} {study.direction.name.lower()}s its metric, this sweep would {direction} it")
    return study


def reclaim_stale(study: Any) -> list[int]:
    """Trials a sweep did not see to the end, asked again with the same parameters: those left running by a process
    of this machine that is gone (killed: marked failed first) and those stopped by a signal (failed, marked
    interrupted). Returns their numbers."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs.get(RETRY_OF) for t in trials}
    stale = []
    for trial in trials:
        if trial.number in retried or not (orphaned(trial) or trial.user_attrs.get(INTERRUPTED)):
            continue
        if trial.state == TrialState.RUNNING:
            study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
        study.enqueue_trial(trial.params, user_attrs={RETRY_OF: trial.number}, skip_if_exists=False)
        log.info("trial %d did not finish (its process is gone, or was stopped): its parameters are asked again",
                 trial.number)
        stale.append(trial.number)
    return stale


def orphaned(trial: Any) -> bool:
    """Whether the trial is marked running by a process of this machine that no longer exists."""
    attrs = trial.user_attrs
    return (trial.state.name == "RUNNING" and attrs.get(HOST) == socket.gethostname()
            and not alive(str(attrs.get(PID, ""))))


def claim(trial: Any) -> None:
    """Mark the trial as this process's, so that a later run knows whether its owner is gone."""
    trial.set_user_attr(HOST, socket.gethostname())
    trial.set_user_attr(PID, os.getpid())


def finished(study: Any) -> int:
    return sum(1 for trial in study.get_trials(deepcopy=False) if trial.state.name in FINISHED)


def pruned_step(trial: Any, err: Exception) -> int | None:
    """The step the trial was pruned at when `err` is its pruning (raised in this process, or by a remote stage that
    ended on it), else None."""
    import optuna

    # read from the storage: the trial object's own attributes are a copy taken before it trained
    step = trial.storage.get_trial_user_attrs(trial._trial_id).get(PRUNED_AT)
    if step is None and isinstance(err, optuna.TrialPruned):
        return 0
    return None if step is None else int(step)


def suggest(trial: Any, dimension: Dimension) -> Any:
    """The trial's value of one dimension (a field drawn before, in a retried trial, is the value it had)."""
    name, low, high = dimension.field, dimension.low, dimension.high
    if dimension.distribution == "categorical":
        return trial.suggest_categorical(name, list(dimension.choices))
    if dimension.distribution == "int":
        return trial.suggest_int(name, int(low or 0), int(high or 0), step=dimension.step, log=dimension.log)
    return trial.suggest_float(name, float(low or 0), float(high or 0), log=dimension.distribution == "log-uniform")


def overrides_of(values: dict[str, Any]) -> list[str]:
    """A trial's values as `field=value` overrides (JSON is YAML: strings stay strings, null stays null)."""
    return [f"{field}={json.dumps(value)}" for field, value in values.items()]
