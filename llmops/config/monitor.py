"""The monitor section: when served requests count as drifted from the version's training data, and what then."""

from __future__ import annotations

from pydantic import Field

from llmops.config.section import Section


class MonitorConfig(Section):
    # a drift test whose p-value falls under this flags drift (each test on its own)
    drift_p_value: float = Field(0.01, gt=0, lt=1)
    # a version answered fewer requests than this in the window: its drift is not judged (too few to test)
    min_requests: int = Field(30, ge=2)
    # `llmops deploy` creates the automation that starts a retraining run on a drift event (off: the event only)
    retrain_on_drift: bool = False
