"""The training pipeline: the stage table, stage by stage, as one Prefect flow.

ingest → validate → dedup → tokenize (→ data report) → train → evaluate → register; each stage a
Prefect task of its own name, on the records of the stages before it (pipeline/stages.py).
"""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.runtime import deployment, flow_run

from llmops.data.lineage import source_tags
from llmops.flows.api import announce
from llmops.flows.prefect_tasks import publish, stage
from llmops.io.files import project_root
from llmops.objectives import load_config
from llmops.pipeline.stages import STAGES
from llmops.tracking.runs import pipeline_run

DEFAULT_CONFIG = "configs/default.yaml"


@flow(name="training_pipeline", log_prints=True)
def training_pipeline(config_path: str = DEFAULT_CONFIG, overrides: list[str] | None = None,
                      trigger_event_id: str | None = None, trigger_event: str | None = None) -> dict:
    """Turn the configured dataset into a trained, evaluated and registered model.

    `trigger_event_id` and `trigger_event` name the Prefect event that started the run, when one did: the
    registered version carries them."""
    config = load_config(config_path, overrides or [])
    announce(config)
    tags = {"prefect_flow_run_id": str(flow_run.id or "none"), "config_path": config_path,
            "trigger_event_id": trigger_event_id or "", "trigger_event": trigger_event or "",
            **source_tags(f"training_pipeline ({config_path})", project_root(), scheduled=deployment.id is not None)}
    with pipeline_run(config, str(flow_run.name or "local"), {k: v for k, v in tags.items() if v}) as run:
        records: dict[str, Any] = {}
        for spec in STAGES:
            records[spec.name] = stage(spec.name, config, run, *(records[up] for up in spec.upstream),
                                       before=list(records.values()))
        publish(config, config_path, overrides or [], list(records.values()))
    return {
        "mlflow_run_id": run.run_id,
        "registration": {**records["register"].model_dump(), "reused": records["register"].reused},
        "stages": {name: "reused" if record.reused else "computed" for name, record in records.items()},
    }
