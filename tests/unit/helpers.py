"""Run the data stages of a config the way the flow does, for tests of later stages."""

from __future__ import annotations

from flows.config import PipelineConfig
from tasks.dedup import dedup
from tasks.ingest import ingest
from tasks.tokenize import tokenize
from tasks.validate import validate
from tasks.workspace import StageRecord, project_root


def data_stages(config: PipelineConfig) -> tuple[StageRecord, StageRecord]:
    root = project_root()
    validated = validate(config.validation, config.data, ingest(config.data, root))
    deduped = dedup(config.dedup, config.data, validated)
    return deduped, tokenize(config.tokenize, config.model, config.data, deduped, root)
