"""Retrain when the data changes: compare the data on disk with what the newest version was trained on."""

from __future__ import annotations

from prefect import flow

from flows.pipeline import DEFAULT_CONFIG, training_pipeline
from flows.prefect_tasks import detect_data_change
from tasks.config import load_config


@flow(name="retrain_on_data_change", log_prints=True)
def retrain_on_data_change(config_path: str = DEFAULT_CONFIG, overrides: list[str] | None = None) -> dict:
    """Run training_pipeline only when the configured data differs from the newest registered version's."""
    config = load_config(config_path, overrides or [])
    change = detect_data_change(config)
    if not change["changed"]:
        print(f"data unchanged since version {change['version']}: nothing to retrain")
        return {"retrained": False, **change}
    print(f"data changed ({change['reason']}): retraining")
    return {"retrained": True, **change, **training_pipeline(config_path, overrides or [])}
