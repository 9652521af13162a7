"""One stage at a time, without Prefect: what `dvc repro` runs for each stage of dvc.yaml.

Each stage reads the records of the stages before it from the workspace and writes its own,
so DVC sees the same chain of stages as the flow, and both reuse the same artifacts.
"""

from __future__ import annotations

from collections.abc import Callable

from flows.config import PipelineConfig
from tasks.dedup import dedup
from tasks.evaluate import evaluate
from tasks.ingest import ingest
from tasks.lineage import collect_lineage
from tasks.register import register
from tasks.report import describe
from tasks.tokenize import tokenize
from tasks.tracking import pipeline_run
from tasks.train import train
from tasks.validate import check_bad_fraction, validate
from tasks.versions import publish_records, read_record, write_record
from tasks.workspace import StageRecord, project_root


def run_validate(config: PipelineConfig) -> StageRecord:
    record = validate(config.validation, config.data, read_record("ingest"))
    publish_records([record])
    check_bad_fraction(record, config.validation.max_bad_fraction)
    return record


def run_register(config: PipelineConfig) -> None:
    root = project_root()
    ingested = ingest(config.data, root)
    with pipeline_run(config, "dvc-repro", {"runner": "dvc"}) as run:
        lineage = collect_lineage(config.digest(), ingested, "dvc-repro", root)
        card = (read_record("report").dir / "dataset_card.md").read_text()
        registration = register(config.registry, run, read_record("train"), read_record("evaluate"), lineage,
                                config.data.kind, card)
    write_record("register", registration.model_dump_json(indent=2, exclude={"reused"}))


STAGE_RUNNERS: dict[str, Callable[[PipelineConfig], StageRecord]] = {
    "ingest": lambda c: ingest(c.data, project_root()),
    "validate": run_validate,
    "dedup": lambda c: dedup(c.dedup, c.data, read_record("validate")),
    "tokenize": lambda c: tokenize(c.tokenize, c.model, c.data, read_record("dedup"), project_root()),
    # ingest again (a reuse) rather than its stored record: the DVC state is read at run time
    "report": lambda c: describe(c, ingest(c.data, project_root()), read_record("validate"), read_record("dedup"),
                                 read_record("tokenize")),
    "train": lambda c: train(c.train, c.model, c.data, read_record("tokenize")),
    "evaluate": lambda c: evaluate(c.evaluate, c.model, c.train.seed, c.data, read_record("train"),
                                   read_record("tokenize"), read_record("dedup")),
}


def run_stage(name: str, config: PipelineConfig) -> None:
    if name == "register":
        run_register(config)
        return
    publish_records([STAGE_RUNNERS[name](config)])
