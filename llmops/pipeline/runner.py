"""The stage runner: keys, registered starting models, artifacts and tracking around each stage of the table.

A stage function only builds (pipeline/stages.py); the runner computes its key from the config, the
upstream keys, the inputs' fingerprints and the code it runs (with the selected objective's), hands
it a config whose `models:/` starting model is a local folder, finds its artifact here or in the
shared store or has it built, logs what it did to the run, and applies its gate. Inside the flow it
runs as a Prefect task; alone (`llmops stage NAME`, what dvc repro runs) it reads the records of the
stages before it from the workspace's records folder and writes its own there, so DVC sees the same
chain as the flow, and both reuse the same artifacts. What it calls in the layers above its own (the
stage functions, the registry's starting models and cost, the objective's code, the run's lineage)
it finds by the import paths the stage table names.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmops.config.schema import PipelineConfig
from llmops.io.errors import MissingInputError, UserError
from llmops.io.figures import ONE_CPU
from llmops.io.files import project_root
from llmops.pipeline import keys
from llmops.pipeline.stages import (
    NAMES,
    OBJECTIVE_CODE,
    RESOLVE_BASE,
    SOURCE_TAGS,
    SPLIT_DATASETS,
    STAGES,
    Stage,
    StageContext,
    stage,
)
from llmops.store import artifacts
from llmops.store.artifacts import StageRecord
from llmops.store.shared import open_store
from llmops.store.workspace import artifact_dir, records_dir, write_atomically, write_record
from llmops.tracking import log as tracking
from llmops.tracking import runs
from llmops.tracking.log import RunHandle

log = logging.getLogger("llmops.stages")
PARAMS_FILE = "params.yaml"


def resolve(path: str) -> Callable[..., Any]:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def record_type(name: str) -> type:
    """The record a stage hands on: its figures in a StageRecord, or what a stage without an artifact returns (the
    stage table says which)."""
    spec = stage(name)
    returned = resolve(spec.returns)
    return StageRecord[returned] if spec.artifact else returned


def key_of(name: str, config: PipelineConfig, upstream_keys: dict[str, str], built: PipelineConfig,
           root: Path) -> str:
    """The stage's key: reads of the config as written, inputs of the config as built (a registered starting
    model is known by its content, not by where it was exported to)."""
    spec = stage(name)
    return keys.stage_key(name, config, upstream_keys, keys.inputs_of(spec, built, root),
                          resolve(OBJECTIVE_CODE)(config.data, spec.objective_code))


def reads_model(spec: Stage) -> bool:
    """Whether the stage reads the model section, where a registered starting model (models:/) is named."""
    return any(read in ("", "model") or read.startswith("model.") for read in spec.reads)


def built_for(spec: Stage, config: PipelineConfig) -> PipelineConfig:
    """The config a stage builds with: a registered starting model as its local folder, for the stages that read
    the model (the data stages never look the registry up)."""
    return resolve(RESOLVE_BASE)(config) if reads_model(spec) and spec.artifact else config


def plan(config: PipelineConfig, root: Path) -> dict[str, str]:
    """Every stage's key for this config and these inputs, computed before anything runs."""
    found: dict[str, str] = {}
    for spec in STAGES:
        found[spec.name] = key_of(spec.name, config, {up: found[up] for up in spec.upstream},
                                  built_for(spec, config), root)
    return found


def planned(config: PipelineConfig) -> list[tuple[str, str, str]]:
    """(stage, key, 'reused' or 'computed') for each stage, before anything runs."""
    rows = []
    for name, key in plan(config, project_root()).items():
        if not stage(name).artifact:
            rows.append((name, key, "runs on every pipeline run"))
            continue
        done = (artifact_dir(name, key) / artifacts.RECORD_FILE).is_file()
        rows.append((name, key, "reused" if done else "computed"))
    return rows


def run_stage(name: str, config: PipelineConfig, upstream: list[Any], run: RunHandle | None = None,
              before: list[Any] | None = None) -> Any:
    """Run one stage on its upstream records, log what it did to the run, then apply its gate.

    With `workspace.remote` set, upstream artifacts built elsewhere are pulled first, and the stage's own
    artifact is looked for in the remote before it is built and pushed there after. `before` holds the records
    of the run's stages so far: a stage that takes the run's cost (register) is given it, accounted from them."""
    spec = stage(name)
    given = tuple(getattr(record, "stage", "?") for record in upstream)
    if given != spec.upstream:
        raise ValueError(f"stage {name} takes the records of {', '.join(spec.upstream) or 'no stage'}, "
                         f"got {', '.join(given) or 'none'}")
    started = time.perf_counter()
    with artifacts.sharing(open_store(config.workspace.remote), config.workspace.leader_wait_minutes * 60):
        for record in upstream:
            if stage(record.stage).artifact:
                artifacts.ensure_local(record)
        record = produce(spec, config, upstream, run, before)
    seconds = time.perf_counter() - started
    log.info("%s: %s in %.1fs", name, "reused" if record.reused else "computed", seconds)
    if run is not None and spec.artifact:
        log_stage(spec, run, record, seconds)
        log_datasets(spec, config, run, record)
    if spec.gate is not None:
        resolve(spec.gate)(config, record)
    return record


def build_stage(name: str, config: PipelineConfig, *upstream: Any, run: RunHandle | None = None) -> Any:
    """A stage's record on these upstream records, without the run's logging or the stage's gate: what a test or a
    notebook calls to get one stage's artifact."""
    return produce(stage(name), config, list(upstream), run)


def produce(spec: Stage, config: PipelineConfig, upstream: list[Any], run: RunHandle | None,
            before: list[Any] | None = None) -> Any:
    """The stage's record: its artifact found or built under its key (the build timed on the devices the stage
    holds); a stage without an artifact just runs."""
    function = resolve(spec.function)
    if not spec.artifact:
        spent = resolve(spec.cost)(config, [*(before or []), *upstream], run) if spec.cost else None
        return function(config, *upstream, StageContext(run=run, cost=spent))
    built = built_for(spec, config)
    held = resolve(spec.holds)(built) if spec.holds else ONE_CPU
    key = key_of(spec.name, config, {record.stage: record.key for record in upstream}, built, project_root())
    content = resolve(spec.content) if spec.content else artifacts.everything

    def build(folder: Path) -> Any:
        return function(built, *upstream, StageContext(folder=folder, key=key, run=run))

    follower = resolve(spec.follower)(built) if spec.follower else 0
    return artifacts.build_artifact(record_type(spec.name), spec.name, key, build, upstream, content=content,
                                    resumable=spec.resumable, held=held, follower=follower)


def log_stage(spec: Stage, run: RunHandle, record: Any, seconds: float) -> None:
    tracking.log_stage(run.tracking, run.run_id, record, seconds)
    for name in spec.logged_files:
        tracking.log_file(run, record.dir / name, spec.logged_folder)
    for name in spec.logged_tables:
        tracking.log_rows_table(run, record.dir / name, f"{spec.logged_folder}/{Path(name).stem}.json")


def log_datasets(spec: Stage, config: PipelineConfig, run: RunHandle, record: Any) -> None:
    """The splits the stage wrote as the run's MLflow datasets; a source that cannot be described now (moved since it
    was read) costs the run page its datasets, not the run."""
    if not spec.logged_datasets:
        return
    try:
        found = resolve(SPLIT_DATASETS)(config, record.dir, spec.logged_datasets, record.key, project_root())
    except (UserError, OSError) as err:
        log.warning("the run's datasets are not logged: %s", err)
        return
    tracking.log_datasets(run, found)


def read_record(name: str) -> Any:
    path = records_dir() / f"{name}.json"
    if not path.is_file():
        raise MissingInputError(f"{path}: no record of stage {name!r}; run the stages before it first")
    return record_type(name).model_validate_json(path.read_text()).model_copy(update={"reused": True})


def publish_records(config: PipelineConfig, records: list[Any]) -> None:
    """Each stage's record (stable bytes: no run-time fields) and the resolved config, where dvc.yaml expects them."""
    write_params(config)
    for record in records:
        write_record(record.stage, record.model_dump_json(indent=2, exclude=per_run_fields(record)))


def per_run_fields(record: Any) -> set[str]:
    """A record's fields that say what one run did rather than what it made (marked `per_run`)."""
    return {name for name, field in type(record).model_fields.items()
            if isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get("per_run")}


def write_params(config: PipelineConfig) -> Path:
    import yaml

    return write_record_file(PARAMS_FILE, yaml.safe_dump(tracking.public_config(config), sort_keys=True))


def write_record_file(name: str, content: str) -> Path:
    folder = records_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    if not path.is_file() or path.read_text() != content:  # unchanged bytes keep DVC's view unchanged
        write_atomically(path, content)
    return path


def run_alone(name: str, config: PipelineConfig) -> Any:
    """One stage, on the records the stages before it wrote; what `llmops stage NAME` and `dvc repro` run."""
    spec = stage(name)
    upstream = [read_record(up) for up in spec.upstream]
    if spec.artifact:
        record = run_stage(name, config, upstream)
    else:
        # each stage ran as a command of its own: to this one, every artifact before it is reused
        before = [read_record(other.name) for other in STAGES[:NAMES.index(name)] if other.artifact]
        tags = {"runner": "stage", **resolve(SOURCE_TAGS)(f"llmops stage {name}", project_root(), scheduled=False)}
        with runs.pipeline_run(config, f"stage-{name}", tags) as run:
            record = run_stage(name, config, upstream, run, before)
    publish_records(config, [record])
    return record


def run_chain(config: PipelineConfig, run: RunHandle | None = None, through: str | None = None) -> dict[str, Any]:
    """The stages of the table in order, each on its upstream records, up to and including `through`; records by
    stage. What the flow does, without Prefect."""
    records: dict[str, Any] = {}
    for spec in STAGES:
        records[spec.name] = run_stage(spec.name, config, [records[up] for up in spec.upstream], run,
                                       list(records.values()))
        if spec.name == through:
            break
    return records
