"""Retrain when the data changes: on a `llmops.data.updated` event, or by polling the data a checkout pins.

A run started by the event knows the DVC md5 the event announced; one started by the schedule
compares the data on disk with what the newest version was trained on. Either way it trains only
on complete data, and never twice on one data version with one config.
"""

from __future__ import annotations

from prefect import flow

from llmops.flows.pipeline import DEFAULT_CONFIG, training_pipeline
from llmops.flows.prefect_tasks import check_data, detect_data_change
from llmops.objectives import handing, load_config

# a file must have stopped changing for this long before a run trains on it (data DVC verified needs no wait)
SETTLE_SECONDS = 30.0


@flow(name="retrain_on_data_change", log_prints=True)
def retrain_on_data_change(config_path: str = DEFAULT_CONFIG, overrides: list[str] | None = None,
                           data_md5: str | None = None, trigger_event_id: str | None = None,
                           trigger_event: str | None = None, settle_seconds: float = SETTLE_SECONDS) -> dict:
    """Run training_pipeline when the configured data is complete and no version was trained on it yet.

    `data_md5` is the DVC md5 an event announced; `trigger_event_id` and `trigger_event` name that event, and the
    registered version carries them."""
    config = load_config(config_path, overrides or [])
    reason = check_data(config, data_md5, settle_seconds)
    if reason:
        print(f"not retraining: {reason}")
        return {"retrained": False, "reason": reason, "version": None}
    change = detect_data_change(config, data_md5)
    if not change["changed"]:
        print(f"{change['reason']}: nothing to retrain")
        return {"retrained": False, **change}
    print(f"data changed ({change['reason']}): retraining")
    with handing(config, config_path, overrides or []):
        summary = training_pipeline(config_path, overrides or [], trigger_event_id=trigger_event_id,
                                    trigger_event=trigger_event)
    return {"retrained": True, **change, **summary}
