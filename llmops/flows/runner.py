"""Running a stage of the stage table: inside the flow (tracked), or alone (`llmops stage NAME`, what dvc repro runs).

Alone, a stage reads the records of the stages before it from the workspace's records folder and
writes its own there, so DVC sees the same chain as the flow, and both reuse the same artifacts.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import time
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmops.core import tracking, workspace
from llmops.core.config import PipelineConfig
from llmops.core.stages import Stage, stage
from llmops.core.store import open_store
from llmops.core.tracking import RunHandle
from llmops.data.versions import records_dir, write_atomically, write_record

log = logging.getLogger("llmops.stages")
PARAMS_FILE = "params.yaml"


def resolve(path: str) -> Callable[..., Any]:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def record_type(name: str) -> type:
    """The record class a stage returns, from its function's annotation."""
    return typing.get_type_hints(resolve(stage(name).function))["return"]


def run_stage(name: str, config: PipelineConfig, upstream: list[Any], run: RunHandle | None = None) -> Any:
    """Run one stage on its upstream records, log what it did to the run, then apply its gate.

    With `workspace.remote` set, upstream artifacts built elsewhere are pulled first, and the stage's own
    artifact is looked for in the remote before it is built and pushed there after."""
    spec = stage(name)
    given = tuple(getattr(record, "stage", "?") for record in upstream)
    if given != spec.upstream:
        raise ValueError(f"stage {name} takes the records of {', '.join(spec.upstream) or 'no stage'}, "
                         f"got {', '.join(given) or 'none'}")
    function = resolve(spec.function)
    extra = {"run": run} if "run" in inspect.signature(function).parameters else {}
    started = time.perf_counter()
    with workspace.sharing(open_store(config.workspace.remote)):
        for record in upstream:
            if stage(record.stage).artifact:
                workspace.ensure_local(record)
        record = function(config, *upstream, **extra)
    seconds = time.perf_counter() - started
    log.info("%s: %s in %.1fs", name, "reused" if record.reused else "computed", seconds)
    if run is not None and spec.artifact:
        log_stage(spec, run, record, seconds)
    if spec.gate is not None:
        resolve(spec.gate)(config, record)
    return record


def log_stage(spec: Stage, run: RunHandle, record: Any, seconds: float) -> None:
    tracking.log_stage(run.tracking, run.run_id, record, seconds)
    for name in spec.logged_files:
        tracking.log_file(run, record.dir / name, spec.logged_folder)
    for name in spec.logged_tables:
        tracking.log_rows_table(run, record.dir / name, f"{spec.logged_folder}/{Path(name).stem}.json")


def read_record(name: str) -> Any:
    path = records_dir() / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no record of stage {name!r}; run the stages before it first")
    return record_type(name).model_validate_json(path.read_text()).model_copy(update={"reused": True})


def publish_records(config: PipelineConfig, records: list[Any]) -> None:
    """Each stage's record (stable bytes: no run-time fields) and the resolved config, where dvc.yaml expects them."""
    write_params(config)
    for record in records:
        write_record(record.stage, record.model_dump_json(indent=2))


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
        with tracking.pipeline_run(config, f"stage-{name}", {"runner": "stage"}) as run:
            record = run_stage(name, config, upstream, run)
    publish_records(config, [record])
    return record


def planned(config: PipelineConfig) -> list[tuple[str, str, str]]:
    """(stage, key, 'reused' or 'computed') for each stage, before anything runs."""
    from llmops.core.keys import plan
    from llmops.core.workspace import RECORD_FILE, artifact_dir, project_root

    rows = []
    for name, key in plan(config, project_root()).items():
        if not stage(name).artifact:
            rows.append((name, key, "runs on every pipeline run"))
            continue
        rows.append((name, key, "reused" if (artifact_dir(name, key) / RECORD_FILE).is_file() else "computed"))
    return rows
