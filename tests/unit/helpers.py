"""Run the data stages of a config the way the flow does, for tests of later stages."""

from __future__ import annotations

from typing import Any

from flows.stages import run_stage
from tasks import tracking
from tasks.config import PipelineConfig
from tasks.dedup import DedupRecord, dedup
from tasks.ingest import ingest
from tasks.stages import STAGES
from tasks.tokenize import TokenizeRecord, tokenize
from tasks.validate import validate


def data_stages(config: PipelineConfig) -> tuple[DedupRecord, TokenizeRecord]:
    deduped = dedup(config, validate(config, ingest(config)))
    return deduped, tokenize(config, deduped)


def run_all_stages(config: PipelineConfig, run_name: str) -> dict[str, Any]:
    """Every stage of the stage table in one MLflow run, as the flow runs them (without Prefect); records by stage."""
    records: dict[str, Any] = {}
    with tracking.pipeline_run(config, run_name, {}) as run:
        for spec in STAGES:
            records[spec.name] = run_stage(spec.name, config, [records[up] for up in spec.upstream], run)
    return records
