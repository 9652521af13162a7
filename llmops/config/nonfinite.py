"""The `train.nonfinite` section: what a training does when a step's gradient norm is NaN or infinite.

A non-finite gradient norm (a NaN or infinite loss gives one too) is seen at the step it happens
(training/nonfinite.py). `skip` leaves the weights and the optimizer's state as they were and goes on,
`max_skips` times in the whole training; the next one, or the first with `stop`, ends the training in
one line naming the step and the last checkpoint saved before it, which is kept. A NaN is rarely a
one-off: a training whose steps keep failing has diverged, and going on only spends the devices.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from llmops.config.section import Section


class NonfiniteConfig(Section):
    # skip: the step's update is dropped (up to max_skips of them); stop: the training ends at the first one
    action: Literal["skip", "stop"] = "skip"
    # skipped steps allowed in the whole training (action skip); one more stops it
    max_skips: int = Field(5, ge=0)
