"""The `engine` section: where the sharded data stages do their work, one machine or a Ray cluster.

It is placement: whichever engine and however many workers, a stage writes the same bytes, so no
stage key and no config hash covers it.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    # local: a process pool on this machine (no Ray needed); ray: a Ray Data map on a Ray cluster (the `ray` extra)
    name: Literal["local", "ray"] = "local"
    # a running Ray cluster (ray://host:10001, host:6379 or auto); None: RAY_ADDRESS, else a local cluster
    # started for the run
    address: str | None = None
    # processes working on shards at once; None: every core of this machine (local), every CPU of the cluster (ray)
    workers: int | None = Field(None, ge=1)
    # the size of a shard of a stage's input, in bytes: the unit of parallel work and of memory per worker
    shard_bytes: int = Field(32 * 2**20, ge=1024)

    @model_validator(mode="before")
    @classmethod
    def name_shorthand(cls, raw: Any) -> Any:
        """`engine: ray` is `engine: {name: ray}`."""
        return {"name": raw} if isinstance(raw, str) else raw

    def ray_address(self) -> str | None:
        """The cluster to join: the configured one, else RAY_ADDRESS; None starts a local one."""
        return self.address or os.environ.get("RAY_ADDRESS") or None

    def local_workers(self) -> int:
        # the CPUs this process may use (a container's or a job's share), not the host's
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return self.workers or usable or 1
