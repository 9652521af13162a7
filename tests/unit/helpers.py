"""Run the data stages of a config the way the flow does, for tests of later stages."""

from __future__ import annotations

from typing import Any

from llmops.core import tracking
from llmops.core.config import PipelineConfig
from llmops.core.stages import STAGES
from llmops.data.dedup import DedupRecord, dedup
from llmops.data.ingest import ingest
from llmops.data.tokenize import TokenizeRecord, tokenize
from llmops.data.validate import validate
from llmops.flows.runner import run_stage


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
