"""The training pipeline: ingest → validate → dedup → tokenize (→ data report) → train → evaluate → register."""

from __future__ import annotations

from prefect import flow
from prefect.runtime import flow_run

from llmops.core.config import load_config
from llmops.core.tracking import pipeline_run
from llmops.flows.environment import announce
from llmops.flows.prefect_tasks import publish, stage

DEFAULT_CONFIG = "configs/default.yaml"


@flow(name="training_pipeline", log_prints=True)
def training_pipeline(config_path: str = DEFAULT_CONFIG, overrides: list[str] | None = None,
                      trigger_event_id: str | None = None, trigger_event: str | None = None) -> dict:
    """Turn the configured dataset into a trained, evaluated and registered model.

    `trigger_event_id` and `trigger_event` name the Prefect event that started the run, when one did: the
    registered version carries them."""
    config = load_config(config_path, overrides or [])
    announce(config)
    run_name = str(flow_run.name or "local")
    tags = {"prefect_flow_run_id": str(flow_run.id or "none"), "config_path": config_path,
            "trigger_event_id": trigger_event_id or "", "trigger_event": trigger_event or ""}
    with pipeline_run(config, run_name, {name: value for name, value in tags.items() if value}) as run:
        ingested = stage("ingest", config, run)
        validated = stage("validate", config, run, ingested)
        deduped = stage("dedup", config, run, validated)
        tokenized = stage("tokenize", config, run, deduped)
        described = stage("report", config, run, ingested, validated, deduped, tokenized)
        trained = stage("train", config, run, tokenized)
        evaluated = stage("evaluate", config, run, trained, tokenized, deduped)
        registration = stage("register", config, run, ingested, trained, evaluated, described)
        records = [ingested, validated, deduped, tokenized, described, trained, evaluated, registration]
        publish(config, config_path, overrides or [], records)
    return {
        "mlflow_run_id": run.run_id,
        "registration": {**registration.model_dump(), "reused": registration.reused},
        "stages": {record.stage: "reused" if record.reused else "computed" for record in records},
    }

