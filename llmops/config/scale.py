"""How a training spreads over a Ray cluster (engine: ray): what each Ray Train worker holds and how often a failed
worker group restarts. Where and how robustly a training runs, not what it makes: no stage key covers it."""

from __future__ import annotations

from pydantic import Field

from llmops.config.section import Section


class RayTrainConfig(Section):
    # GPUs each training worker holds; None: one where this machine has a GPU, none (CPU workers, gloo) where not
    gpus_per_worker: float | None = Field(None, ge=0)
    # CPUs each training worker holds (1)
    cpus_per_worker: float = Field(1.0, gt=0)
    # restarts of the worker group after a worker or its machine fails, each from the last checkpoint (Ray Train's
    # FailureConfig.max_failures); 0 (the default): a failure fails the stage, -1: no limit
    max_failures: int = Field(0, ge=-1)
