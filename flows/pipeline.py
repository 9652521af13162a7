"""The training pipeline: ingest → validate → dedup → tokenize (→ data report) → train → evaluate → register."""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run

from flows.config import load_config
from tasks.dedup import dedup_task
from tasks.evaluate import evaluate_task
from tasks.ingest import ingest_task
from tasks.register import register_task
from tasks.report import report_task
from tasks.tokenize import tokenize_task
from tasks.tracking import pipeline_run
from tasks.train import train_task
from tasks.validate import validate_task
from tasks.versions import publish_records_task

DEFAULT_CONFIG = "configs/default.yaml"


@flow(name="training_pipeline", log_prints=True)
def training_pipeline(config_path: str = DEFAULT_CONFIG, overrides: list[str] | None = None) -> dict:
    """Turn the configured dataset into a trained, evaluated and registered model."""
    config = load_config(config_path, overrides or [])
    run_name = str(flow_run.name or "local")
    with pipeline_run(config, run_name, {"prefect_flow_run_id": str(flow_run.id or "none"),
                                         "config_path": config_path}) as run:
        ingested = ingest_task(config, run)
        validated = validate_task(config, ingested, run)
        deduped = dedup_task(config, validated, run)
        tokenized = tokenize_task(config, deduped, run)
        described = report_task(config, ingested, validated, deduped, tokenized, run)
        trained = train_task(config, tokenized, run)
        evaluated = evaluate_task(config, trained, tokenized, deduped, run)
        registration = register_task(config, ingested, trained, evaluated, described, run)
        stages = [ingested, validated, deduped, tokenized, described, trained, evaluated]
        publish_records_task(config, Path(config_path), overrides or [], stages, registration)
    return {
        "mlflow_run_id": run.run_id,
        "registration": registration.model_dump(),
        "stages": {record.stage: "reused" if record.reused else "computed" for record in stages},
    }
