"""The Prefect tasks: thin wrappers that run a stage of the stage table, named after it, with its retries."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from llmops.config.schema import PipelineConfig
from llmops.data.versions import can_commit_lock, commit_lock
from llmops.flows.remote import dispatch, work_pool
from llmops.io.errors import worth_retrying
from llmops.io.files import project_root
from llmops.pipeline.keys import lookup
from llmops.pipeline.runner import publish_records, run_stage
from llmops.pipeline.stages import stage as table_entry
from llmops.registry.register import data_change
from llmops.registry.retraining import not_ready, version_trained_on
from llmops.tracking.log import RunHandle

# artifacts are found and reused by their own keys, so Prefect's result cache stays out of the way: a cache
# hit would skip the stage's record in MLflow and could hand back an artifact that is gone
RETRY_DELAY_SECONDS = 5


def stage(name: str, config: PipelineConfig, tracking_run: RunHandle, *upstream: Any,
          before: list[Any] | None = None) -> Any:
    """Run stage `name` as a Prefect task of the same name: here, or on a worker of the pool the config names;
    `before` holds the run's records so far (the register stage accounts the run's cost from them)."""
    spec = table_entry(name)
    retries = lookup(config, spec.retries_field) if spec.retries_field else spec.retries
    pool = work_pool(name, config)
    if pool:
        sender = task(dispatch, name=name, cache_policy=NO_CACHE, retries=retries,
                      retry_delay_seconds=RETRY_DELAY_SECONDS, retry_condition_fn=retry_if_it_can_help)
        return sender(name, pool, config, tracking_run, list(upstream))
    wrapper = task(run_stage, name=name, cache_policy=NO_CACHE, retries=retries,
                   retry_delay_seconds=RETRY_DELAY_SECONDS, retry_condition_fn=retry_if_it_can_help)
    return wrapper(name, config, list(upstream), tracking_run, before)


def retry_if_it_can_help(task: Any, task_run: Any, state: Any) -> bool:
    """A stage that failed on the user's config or data, or that no worker took, is not run again: it would fail
    the same way, later."""
    return worth_retrying(state.data)


@task(name="publish records", cache_policy=NO_CACHE)
def publish(config: PipelineConfig, config_path: str, overrides: list[str], records: list[Any]) -> None:
    """Write the stage records where dvc.yaml expects them and, for the config dvc.yaml tracks, commit dvc.lock."""
    import logging

    log = logging.getLogger("llmops.versions")
    publish_records(config, records)
    root = project_root()
    path = Path(config_path)
    reason = can_commit_lock(root, path if path.is_absolute() else root / path, overrides)
    if not config.orchestration.commit_dvc_lock or reason:
        log.info("dvc.lock left as it is: %s", reason or "orchestration.commit_dvc_lock is off")
        return
    from dvc.exceptions import DvcException

    try:
        commit_lock(root)
    except DvcException as err:  # the model is registered; a stale lock only makes `dvc status` say so
        log.warning("dvc.lock not updated: %s", err)


@task(name="check data", cache_policy=NO_CACHE)
def check_data(config: PipelineConfig, announced_md5: str | None, settle_seconds: float) -> str | None:
    """Why the data must not start a run now (not the announced version, or still being written), or None."""
    return not_ready(config, project_root(), announced_md5, settle_seconds)


@task(name="detect data change", cache_policy=NO_CACHE)
def detect_data_change(config: PipelineConfig, announced_md5: str | None = None) -> dict[str, Any]:
    """Whether to train: not when a version was trained on the announced md5 with this config, else when the data
    differs from what the newest version was trained on."""
    trained = version_trained_on(config, announced_md5) if announced_md5 else None
    if trained is not None:
        return {"changed": False, "reason": f"version {trained} was trained on data md5 {announced_md5}",
                "version": trained}
    change = data_change(config)
    return {**change, "reason": change["reason"] or f"data unchanged since version {change['version']}"}
