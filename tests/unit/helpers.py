"""Run the data stages of a config the way the flow does, for tests of later stages."""

from __future__ import annotations

from tasks.config import PipelineConfig
from tasks.dedup import DedupRecord, dedup
from tasks.ingest import ingest
from tasks.tokenize import TokenizeRecord, tokenize
from tasks.validate import validate


def data_stages(config: PipelineConfig) -> tuple[DedupRecord, TokenizeRecord]:
    deduped = dedup(config, validate(config, ingest(config)))
    return deduped, tokenize(config, deduped)
