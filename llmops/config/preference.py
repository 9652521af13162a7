"""The `preference` section: what the preference objectives (DPO, ORPO, KTO) read, beside the objectives that read
it, as TRL keeps DPOConfig beside DPOTrainer. Only those objectives may set it (objectives/config.py)."""

from __future__ import annotations

from pydantic import Field

from llmops.config.section import Section


class PreferenceConfig(Section):
    # DPO's and KTO's beta, how strongly the trained model is held to its starting model (larger: closer); ORPO's
    # lambda, the weight of its odds-ratio term; the implied reward of DPO's and KTO's evaluation figures
    beta: float = Field(0.1, gt=0)
