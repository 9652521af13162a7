"""MLflow: the record of every run. Local SQLite store by default, any tracking server if configured.

Credentials in a tracking URI (http://user:password@host) never reach MLflow's URI, a param, a tag
or a log line: MLflow gets them from its own environment variables, and the URI is shown masked.
Names of params, metrics and tags are the code's own (config field paths, stage and figure names).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from itertools import islice
from numbers import Number
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from pydantic import BaseModel

from llmops.config.schema import PipelineConfig, TrackingConfig
from llmops.io.errors import Transient, UserError
from llmops.io.files import read_jsonl
from llmops.store import settings
from llmops.store.settings import mask
from llmops.store.workspace import exclusive, home
from llmops.tracking.trial import TrialLink

log = logging.getLogger("llmops.tracking")
# the event that started a run: tags of the run and of the version it registers
TRIGGER_TAGS = ("trigger_event_id", "trigger_event")
# rows of a logged table (the quarantine): enough to read, bounded whatever the data
TABLE_ROWS = 1000
# a service's traces go to the pipeline's experiment name with this after it (llmops-serving)
SERVING_SUFFIX = "-serving"
# stores this process has opened (their tables exist): (tracking URI, registry URI)
OPENED_STORES: set[tuple[str, str]] = set()
# what MLflow's SQL schema holds (mlflow/store/*/dbmodels/models.py): PostgreSQL and MySQL refuse a longer value,
# SQLite keeps it; a value that can grow (a reason, a config value, a card) is clipped where it is written
PARAM_LIMIT = 6000  # params.value holds 8,000, but MLflow's client refuses a param over 6,000
RUN_TAG_LIMIT = 8000  # tags.value
MODEL_TAG_LIMIT = 5000  # registered_model_tags.value (and model_version_tags.value in schemas before it was text)
DESCRIPTION_LIMIT = 5000  # registered_models.description, model_versions.description


class TrackingUnavailableError(Transient, UserError, RuntimeError):
    """The tracking server cannot be reached: at the start of a run, or after retries during one."""


class RunHandle(BaseModel):
    """The MLflow run a pipeline run logs into."""

    tracking: TrackingConfig
    run_id: str
    # the Prefect flow run this pipeline run belongs to ("none" outside a flow)
    flow_run_id: str = "none"
    # the event that started it (trigger_event_id, trigger_event), for the registered version's lineage
    trigger: dict[str, str] = {}
    # a sweep's trial this run is (its study and number): where the train stage reports its evaluation loss to be
    # pruned; placement, so no stage key covers it
    trial: TrialLink | None = None


def tracking_uri(config: TrackingConfig) -> str:
    return settings.tracking_uri(config)


def split_credentials(uri: str) -> tuple[str, str | None, str | None]:
    """(the URI without user and password, the user, the password)."""
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri, None, None
    userinfo, _, host = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    return urlunsplit(parts._replace(netloc=host)), unquote(user), unquote(password) if password else None


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
    registry = use_credentials(settings.registry_uri(config))
    # the first touch of a SQLite store creates or migrates its tables: one process at a time
    with local_store_lock(config), user_environment("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):
        mlflow.set_tracking_uri(uri)
        mlflow.set_registry_uri(registry)
        mlflow_client = MlflowClient(tracking_uri=uri, registry_uri=registry)
        if uri.startswith("sqlite:") and (uri, registry) not in OPENED_STORES:
            mlflow_client.search_experiments(max_results=1)
            mlflow_client.search_registered_models(max_results=1)
            OPENED_STORES.add((uri, registry))
    return mlflow_client


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
    raise TrackingUnavailableError(f"MLflow tracking server {mask(bare)} is unreachable ({problem}, "
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
    """Runs sharing a SQLite store (the workspace's, or any on this machine) create its tables and the experiment
    one at a time; a server serialises its own writes."""
    uri = tracking_uri(config)
    database = Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None
    with exclusive(database.with_name(database.name + ".lock")) if database else nullcontext():
        yield


@contextmanager
def registry_lock(model_name: str) -> Iterator[None]:
    """Runs of one workspace register a model one at a time: the second finds the first one's version."""
    name = hashlib.sha256(model_name.encode()).hexdigest()[:16]
    with exclusive(home() / "locks" / f"register-{name}.lock"):
        yield


def serving_tracking(config: TrackingConfig) -> TrackingConfig:
    """Where a service records its requests: the pipeline's experiment name with `-serving` after it, so that served
    traces never mix with training runs."""
    return config.model_copy(update={"experiment": f"{config.experiment}{SERVING_SUFFIX}"})


def experiment_id(config: TrackingConfig) -> str:
    from mlflow.exceptions import MlflowException

    mlflow_client = client(config)
    with local_store_lock(config):
        found = mlflow_client.get_experiment_by_name(config.experiment)
        if found is not None:
            return found.experiment_id
        try:
            return mlflow_client.create_experiment(config.experiment, artifact_location=artifact_location(config))
        except MlflowException as err:  # another run, on another machine, created it first
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            return mlflow_client.get_experiment_by_name(config.experiment).experiment_id


def artifact_location(config: TrackingConfig) -> str | None:
    """Where a new experiment keeps its artifacts: the configured place; for a local store, beside it (MLflow's
    own default is ./mlruns in whatever folder the command runs in); for a server, the server's choice."""
    if config.artifact_location:
        return config.artifact_location
    uri = tracking_uri(config)
    if not settings.is_local_store(uri):
        return None
    if uri.startswith("sqlite:///"):
        return (Path(uri.removeprefix("sqlite:///")).resolve().parent / "artifacts").as_uri()
    return (Path(uri.removeprefix("file://").removeprefix("file:")).resolve() / "artifacts").as_uri()


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
                params[f"{prefix}{key}"] = mask(text)

    walk(config, config.as_dict(), "")
    return params


def public_config(config: PipelineConfig) -> dict[str, Any]:
    """The resolved config with every URI's credentials masked: what may be stored beside a run."""
    return json.loads(mask(json.dumps(config.as_dict())))


def numeric(values: dict[str, Any]) -> dict[str, float]:
    """The numbers among `values`, NaN and infinity included: a diverged training's NaN loss is what its run must
    show (MLflow stores them), not a gap in the curve."""
    return {k: float(v) for k, v in values.items() if isinstance(v, Number) and not isinstance(v, bool)}


def metric_name(group: str, figure: str) -> str:
    """A metric's name, `<group>/<figure>` (e.g. `train/loss`, `evaluate/trained.exact_match`, `cost/useful_tokens`):
    MLflow's UI sections a run's charts by the part before the first '/', so each stage's figures, the loss
    curves and the cost are found together among the run's many metrics."""
    return f"{group}/{figure}"


def grouped(metrics: dict[str, float], group: str) -> dict[str, float]:
    """The metrics of one group, by their figure's name."""
    start = metric_name(group, "")
    return {name.removeprefix(start): value for name, value in metrics.items() if name.startswith(start)}


def log_metrics(config: TrackingConfig, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
    from mlflow.entities import Metric

    stamp = int(time.time() * 1000)
    batch = [Metric(k, v, stamp, step) for k, v in metrics.items()]
    for start in range(0, len(batch), 500):
        client(config).log_batch(run_id, metrics=batch[start:start + 500])


def clip(text: str, limit: int) -> str:
    """The text within `limit` characters: whole when it fits, else cut, with an ellipsis saying so."""
    return text if len(text) <= limit else text[:max(limit - 1, 0)] + "…"


def set_tags(config: TrackingConfig, run_id: str, tags: dict[str, str]) -> None:
    """All tags in one request, not one per tag; a value past the column (a long reason) is clipped."""
    from mlflow.entities import RunTag

    client(config).log_batch(run_id, tags=[RunTag(name, clip(value, RUN_TAG_LIMIT)) for name, value in tags.items()])


def log_stage(config: TrackingConfig, run_id: str, record: Any, seconds: float) -> None:
    """A stage's figures (metrics by code-given names; every figure in a JSON file), whether it computed or
    reused its artifact, and where the artifact is."""
    metrics = {metric_name(record.stage, k): v for k, v in record.figures.loggable().items()}
    metrics[metric_name(record.stage, "seconds")] = seconds
    log_metrics(config, run_id, metrics)
    client(config).log_dict(run_id, record.figures.model_dump(mode="json"), f"figures/{record.stage}.json")
    set_tags(config, run_id, {f"stage.{record.stage}": "reused" if record.reused else "computed",
                              f"stage.{record.stage}.key": record.key, f"stage.{record.stage}.path": str(record.dir)})


# MLflow's column for a dataset's digest
DIGEST_LIMIT = 36
# the run's description in MLflow's UI (its "note")
DESCRIPTION_TAG = "mlflow.note.content"


@dataclass(frozen=True)
class LoggedDataset:
    """A dataset a run read, as MLflow's run page lists it: name, digest, where it is, what the run used it for."""

    name: str
    digest: str
    source_type: str
    source: str
    # MLflow's dataset context: "training", "evaluation"
    context: str
    rows: int


def log_datasets(run: RunHandle, datasets: list[LoggedDataset]) -> None:
    """The datasets as the run's inputs (MLflow's `log_input`), each with its row count as its profile."""
    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    inputs = [DatasetInput(Dataset(name=found.name, digest=found.digest[:DIGEST_LIMIT],
                                   source_type=found.source_type, source=found.source,
                                   profile=json.dumps({"num_rows": found.rows})),
                           tags=[InputTag(MLFLOW_DATASET_CONTEXT, found.context)]) for found in datasets]
    log_inputs_once(run, inputs)


def log_inputs_once(run: RunHandle, inputs: list[Any]) -> None:
    """MLflow's store inserts a dataset it has not seen: two runs logging the same new dataset at once race on that
    insert; the row then exists, and logging again links to it."""
    after_insert_race(lambda: client(run.tracking).log_inputs(run.run_id, datasets=inputs))


def after_insert_race(call: Callable[[], Any], attempts: int = 3) -> None:
    """`call`, again when it lost a race to insert a row another process inserted at the same moment (MLflow's
    stores select, then insert: the loser gets a unique-constraint error, and a second try finds the row)."""
    import time

    from mlflow.exceptions import MlflowException

    for attempt in range(attempts):
        try:
            call()
            return
        except MlflowException as err:
            if attempt == attempts - 1 or not any(word in str(err) for word in ("UNIQUE", "unique", "Integrity")):
                raise
            time.sleep(0.2 * (attempt + 1))


def describe_run(run: RunHandle, description: str) -> None:
    """The run's description in MLflow's UI: its one-line summary."""
    set_tags(run.tracking, run.run_id, {DESCRIPTION_TAG: description})


def log_file(run: RunHandle, path: Path, folder: str) -> None:
    if path.is_file() and path.stat().st_size:
        client(run.tracking).log_artifact(run.run_id, str(path), folder)


def recent_runs(config: TrackingConfig, limit: int) -> list[dict[str, Any]]:
    """The newest runs, with their cost figures (the `cost/*` metrics, none for a run that registered nothing) and
    the links a resume or a clean-up left between them."""
    from datetime import datetime

    mlflow_client = client(config)
    experiment = mlflow_client.get_experiment_by_name(config.experiment)
    if experiment is None:
        return []
    found = mlflow_client.search_runs([experiment.experiment_id], order_by=["attributes.start_time DESC"],
                                      max_results=limit)
    short = {run.info.run_id: run.info.run_id[:8] for run in found}
    rows = []
    for run in found:
        tags, info = run.data.tags, run.info
        ended = info.end_time or int(time.time() * 1000)
        rows.append({"run": short[info.run_id], "name": info.run_name, "status": info.status,
                     "started": datetime.fromtimestamp(info.start_time / 1000).strftime("%Y-%m-%d %H:%M:%S"),
                     "minutes": round((ended - info.start_time) / 60000, 1),
                     "cost": {name: value for name, value in grouped(run.data.metrics, "cost").items()
                              if not name.startswith("stages.")},
                     **{link: short.get(tags.get(f"llmops.{link}", ""), tags.get(f"llmops.{link}", "")[:8])
                        for link in ("resumes", "resumed_by", "closed_by")}})
    return rows


def log_table(run: RunHandle, rows: list[dict[str, Any]], artifact_file: str) -> None:
    """Rows as a table the tracking UI shows (a JSON artifact of columns, every key any row has); nothing for no
    rows."""
    if not rows:
        return
    columns = list(dict.fromkeys(key for row in rows for key in row))
    client(run.tracking).log_table(run.run_id, {c: [row.get(c) for row in rows] for c in columns}, artifact_file)


def log_rows_table(run: RunHandle, path: Path, artifact_file: str, limit: int = TABLE_ROWS) -> int:
    """The first `limit` rows of a JSONL file as a table (bounded, whatever the data); how many."""
    rows = list(islice(read_jsonl(path), limit)) if path.is_file() else []
    log_table(run, rows, artifact_file)
    return len(rows)
