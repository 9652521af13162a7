"""MLflow: the record of every run. Local SQLite store by default, any tracking server if configured.

Credentials in a tracking URI (http://user:password@host) never reach MLflow's URI, a param, a tag
or a log line: MLflow gets them from its own environment variables, and the URI is shown masked.
Names of params, metrics and tags are the code's own (config field paths, stage and figure names).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from itertools import islice
from numbers import Number
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from pydantic import BaseModel

from tasks.config import PipelineConfig, TrackingConfig
from tasks.workspace import exclusive, home, read_jsonl

log = logging.getLogger("llmops.tracking")
# rows of a logged table (the quarantine): enough to read, bounded whatever the data
TABLE_ROWS = 1000
USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")


class TrackingUnavailableError(RuntimeError):
    """The tracking server cannot be reached: at the start of a run, or after retries during one."""


class RunHandle(BaseModel):
    """The MLflow run a pipeline run logs into."""

    tracking: TrackingConfig
    run_id: str
    # the Prefect flow run this pipeline run belongs to ("none" outside a flow)
    flow_run_id: str = "none"


def tracking_uri(config: TrackingConfig) -> str:
    """The configured URI, else MLflow's own MLFLOW_TRACKING_URI, else a SQLite store in the workspace."""
    if config.tracking_uri:
        return config.tracking_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    folder = home() / "mlflow"
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder / 'mlflow.db'}"


def is_local_store(config: TrackingConfig) -> bool:
    return not config.tracking_uri and not os.environ.get("MLFLOW_TRACKING_URI")


def split_credentials(uri: str) -> tuple[str, str | None, str | None]:
    """(the URI without user and password, the user, the password)."""
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri, None, None
    userinfo, _, host = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    return urlunsplit(parts._replace(netloc=host)), unquote(user), unquote(password) if password else None


def mask_secrets(text: str) -> str:
    """Text fit to log: the user and password of every URI in it become ***."""
    return USERINFO.sub(r"\g<scheme>***@", text)


def use_credentials(uri: str) -> str:
    """Hand a URI's user and password to MLflow through its environment variables; return the bare URI."""
    bare, user, password = split_credentials(uri)
    if user:
        os.environ["MLFLOW_TRACKING_USERNAME"] = user
    if password:
        os.environ["MLFLOW_TRACKING_PASSWORD"] = password
    return bare


def without_credentials(overrides: list[str]) -> list[str]:
    """Overrides whose tracking URI holds credentials, with the credentials moved to the environment, so that
    the flow run's recorded parameters never hold them."""
    cleaned = []
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep and key.strip() == "tracking.tracking_uri" and "@" in value:
            override = f"{key}={use_credentials(value.strip())}"
        cleaned.append(override)
    return cleaned


def client(config: TrackingConfig) -> Any:
    import mlflow
    from mlflow import MlflowClient

    uri = use_credentials(tracking_uri(config))
    with user_environment("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):
        mlflow.set_tracking_uri(uri)
        mlflow.set_registry_uri(uri)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


@contextmanager
def user_environment(*names: str) -> Iterator[None]:
    """Keep these variables as the user set them: MLflow copies the URI it is given into them, after which they
    would no longer say what the user chose (and a later config with no URI would follow the copy)."""
    before = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def check_reachable(config: TrackingConfig, attempts: int = 3, delay: float = 0.5) -> None:
    """Fail in one line, before any work, when a tracking server does not answer; a local store always does."""
    bare, user, password = split_credentials(tracking_uri(config))
    if urlsplit(bare).scheme not in ("http", "https"):
        return
    import httpx

    problem = ""
    for attempt in range(attempts):
        try:
            answer = httpx.get(bare.rstrip("/") + "/health", timeout=10,
                               auth=(user, password or "") if user else None)
            if answer.status_code < 500:
                return
            problem = f"HTTP {answer.status_code}"
        except httpx.HTTPError as err:
            problem = str(err) or type(err).__name__
        if attempt + 1 < attempts:
            time.sleep(delay * 2**attempt)
    raise TrackingUnavailableError(f"MLflow tracking server {mask_secrets(bare)} is unreachable ({problem}, "
                                   f"{attempts} attempts): start it, or point tracking.tracking_uri or "
                                   "MLFLOW_TRACKING_URI at one that runs")


def unreachable(err: BaseException, config: TrackingConfig) -> str | None:
    """What failed, when `err` (or an error it arose from) says the tracking server stopped answering after
    MLflow's retries; None for any other error, a hub download's included."""
    import requests

    server = urlsplit(split_credentials(tracking_uri(config))[0])
    if server.scheme not in ("http", "https"):
        return None
    markers = [str(server.hostname), *([str(server.port)] if server.port else [])]
    seen: BaseException | None = err
    while seen is not None:
        text = str(seen)
        lost = isinstance(seen, requests.exceptions.ConnectionError | requests.exceptions.Timeout |
                          requests.exceptions.RetryError) or "Max retries exceeded" in text
        if lost and all(marker in text for marker in markers):
            found = re.search(r"\[Errno -?\d+\] [^'\")]+|Read timed out|too many \d+ error responses", text)
            return found.group() if found else type(seen).__name__
        seen = seen.__cause__ or seen.__context__
    return None


@contextmanager
def local_store_lock(config: TrackingConfig) -> Iterator[None]:
    """Runs sharing the workspace's SQLite store create its tables and the experiment one at a time."""
    with exclusive(home() / "mlflow" / "store.lock") if is_local_store(config) else nullcontext():
        yield


@contextmanager
def registry_lock(model_name: str) -> Iterator[None]:
    """Runs of one workspace register a model one at a time: the second finds the first one's version."""
    name = hashlib.sha256(model_name.encode()).hexdigest()[:16]
    with exclusive(home() / "locks" / f"register-{name}.lock"):
        yield


def experiment_id(config: TrackingConfig) -> str:
    from mlflow.exceptions import MlflowException

    mlflow_client = client(config)
    with local_store_lock(config):
        found = mlflow_client.get_experiment_by_name(config.experiment)
        if found is not None:
            return found.experiment_id
        # the local store keeps its artifacts in the workspace too; a server chooses its own
        location = (home() / "mlflow" / "artifacts").as_uri() if is_local_store(config) else None
        try:
            return mlflow_client.create_experiment(config.experiment, artifact_location=location)
        except MlflowException as err:  # another run, on another machine, created it first
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            return mlflow_client.get_experiment_by_name(config.experiment).experiment_id


def start_run(config: PipelineConfig, run_name: str, tags: dict[str, str]) -> str:
    check_reachable(config.tracking)
    mlflow_client = client(config.tracking)
    run = mlflow_client.create_run(experiment_id(config.tracking), run_name=run_name,
                                   tags={name: mask_secrets(value) for name, value in tags.items()})
    params = config_params(config)
    from mlflow.entities import Param

    for start in range(0, len(params), 100):
        batch = list(params.items())[start:start + 100]
        mlflow_client.log_batch(run.info.run_id, params=[Param(k, v[:6000]) for k, v in batch])
    mlflow_client.log_dict(run.info.run_id, public_config(config), "config/resolved.yaml")
    return run.info.run_id


def end_run(config: TrackingConfig, run_id: str, status: str) -> None:
    client(config).set_terminated(run_id, status=status)


@contextmanager
def pipeline_run(config: PipelineConfig, run_name: str, tags: dict[str, str]) -> Iterator[RunHandle]:
    """An MLflow run for the whole pipeline run: FINISHED when the body completes, FAILED if it raises."""
    run = RunHandle(tracking=config.tracking, run_id=start_run(config, run_name, tags),
                    flow_run_id=tags.get("prefect_flow_run_id", "none"))
    try:
        yield run
    except BaseException as err:
        lost = unreachable(err, config.tracking)
        if lost is None:
            record_failure(config.tracking, run.run_id, err)
            raise
        # the server is what failed: marking the run would only wait out the retries again
        bare = split_credentials(tracking_uri(config.tracking))[0]
        raise TrackingUnavailableError(f"MLflow tracking server {mask_secrets(bare)} stopped answering during the "
                                       f"run ({lost}) and did not come back within the retries; the run "
                                       f"stopped, MLflow run {run.run_id} stays unfinished") from None
    end_run(config.tracking, run.run_id, "FINISHED")


def record_failure(config: TrackingConfig, run_id: str, err: BaseException) -> None:
    """Mark the run FAILED with its error (masked); a tracking problem here must not hide the error itself."""
    try:
        client(config).set_tag(run_id, "failure", mask_secrets(f"{type(err).__name__}: {err}")[:5000])
        end_run(config, run_id, "FAILED")
    except Exception as problem:  # the server may be failing too: the run's own error matters more
        log.warning("could not mark MLflow run %s as failed: %s", run_id, mask_secrets(str(problem))[:300])


def config_params(config: PipelineConfig) -> dict[str, str]:
    """The resolved config as params named by the paths of its fields: only the config model's own field names
    become names; a value the user fills (a list of sources with their column mappings, labels) is one param
    holding its JSON, whatever keys it has. URIs are masked."""
    params: dict[str, str] = {}

    def walk(model: BaseModel, values: dict[str, Any], prefix: str) -> None:
        for name, field in type(model).model_fields.items():
            key = field.alias or name
            child = getattr(model, name)
            if isinstance(child, BaseModel):
                walk(child, values[key], f"{prefix}{key}.")
            else:
                value = values[key]
                text = json.dumps(value, sort_keys=True) if isinstance(value, list | dict) else str(value)
                params[f"{prefix}{key}"] = mask_secrets(text)

    walk(config, config.as_dict(), "")
    return params


def public_config(config: PipelineConfig) -> dict[str, Any]:
    """The resolved config with every URI's credentials masked: what may be stored beside a run."""
    return json.loads(mask_secrets(json.dumps(config.as_dict())))


def numeric(values: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in values.items()
            if isinstance(v, Number) and not isinstance(v, bool) and math.isfinite(float(v))}


def log_metrics(config: TrackingConfig, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
    from mlflow.entities import Metric

    stamp = int(time.time() * 1000)
    batch = [Metric(k, v, stamp, step) for k, v in metrics.items()]
    for start in range(0, len(batch), 500):
        client(config).log_batch(run_id, metrics=batch[start:start + 500])


def set_tags(config: TrackingConfig, run_id: str, tags: dict[str, str]) -> None:
    """All tags in one request, not one per tag."""
    from mlflow.entities import RunTag

    client(config).log_batch(run_id, tags=[RunTag(name, value) for name, value in tags.items()])


def log_stage(config: TrackingConfig, run_id: str, record: Any, seconds: float) -> None:
    """A stage's figures (metrics by code-given names; every figure in a JSON file), whether it computed or
    reused its artifact, and where the artifact is."""
    metrics = {f"{record.stage}.{k}": v for k, v in record.figures.loggable().items()}
    metrics[f"{record.stage}.seconds"] = seconds
    log_metrics(config, run_id, metrics)
    client(config).log_dict(run_id, record.figures.model_dump(mode="json"), f"figures/{record.stage}.json")
    set_tags(config, run_id, {f"stage.{record.stage}": "reused" if record.reused else "computed",
                              f"stage.{record.stage}.key": record.key, f"stage.{record.stage}.path": str(record.dir)})


def log_file(run: RunHandle, path: Path, folder: str) -> None:
    if path.is_file() and path.stat().st_size:
        client(run.tracking).log_artifact(run.run_id, str(path), folder)


def log_rows_table(run: RunHandle, path: Path, artifact_file: str, limit: int = TABLE_ROWS) -> int:
    """The first `limit` rows of a JSONL file as an MLflow table (shown in the UI's artifact view); how many."""
    rows = list(islice(read_jsonl(path), limit)) if path.is_file() else []
    if rows:
        columns = list(dict.fromkeys(key for row in rows for key in row))
        client(run.tracking).log_table(run.run_id, {c: [row.get(c) for row in rows] for c in columns}, artifact_file)
    return len(rows)
