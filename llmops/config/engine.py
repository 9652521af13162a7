"""The `engine` section: where the sharded data stages do their work, one machine or a Ray cluster.

It is placement: whichever engine and however many workers, a stage writes the same bytes, so no
stage key and no config hash covers it. A set `shard_bytes` also decides how ingest's records are cut
into parts: the same records, parted otherwise (ingest's hash follows the parts).
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, model_validator

from llmops.config.section import Section

# the automatic shard size: the largest, the smallest, and how many shards an input is cut into at least
MAX_SHARD = 32 * 2**20
MIN_SHARD = 2**20
SHARDS_PER_WORKER = 4
MIN_SHARDS = 16
# the shards an input is cut into at least when they become the artifact's parts (ingest's records)
CUT_SHARDS = 64


def bounded_shard(total: int, shards: int) -> int:
    """The size that cuts `total` bytes into `shards` shards, kept between MIN_SHARD and MAX_SHARD."""
    return min(MAX_SHARD, max(MIN_SHARD, -(-total // shards)))


class EngineConfig(Section):
    # local: a process pool on this machine (no Ray needed); ray: a Ray Data map on a Ray cluster (the `ray` extra)
    name: Literal["local", "ray"] = "local"
    # a running Ray cluster (host:6379, or auto on one of its machines; not a Ray Client ray:// address); None:
    # RAY_ADDRESS, else a local cluster started for the run
    address: str | None = None
    # processes working on shards at once; None: every core of this machine (local), every CPU of the cluster (ray)
    workers: int | None = Field(None, ge=1)
    # the size of a shard of a stage's input, in bytes: the unit of parallel work and of memory per worker; None:
    # cut each input into at least SHARDS_PER_WORKER shards a worker (and MIN_SHARDS), of MIN_SHARD to MAX_SHARD bytes
    # (ingest's input, whose shards become the records' parts: at least CUT_SHARDS, whatever the workers)
    shard_bytes: int | None = Field(None, ge=1024)

    @model_validator(mode="before")
    @classmethod
    def name_shorthand(cls, raw: Any) -> Any:
        """`engine: ray` is `engine: {name: ray}`."""
        return {"name": raw} if isinstance(raw, str) else raw

    def shard_size(self, total: int, worth_a_worker: int = 0) -> int:
        """The shard size for an input of `total` bytes: the configured one, else one that gives every worker
        several shards to balance (a small input cut in 32 MiB shards would leave workers idle), with no shard over
        MAX_SHARD, which bounds a worker's memory, nor under MIN_SHARD, which keeps a shard's fixed costs small. An
        input under two workers' `worth_a_worker` bytes is one shard, worked in this process: starting a worker (an
        interpreter that imports the stage's libraries) would cost more than sharing the work saves."""
        if self.shard_bytes is not None:
            return self.shard_bytes
        if total < 2 * worth_a_worker:
            return max(total, 1)
        # on Ray without a worker count, this machine's CPUs stand in for the cluster's: the count is a floor only
        return bounded_shard(total, max(MIN_SHARDS, SHARDS_PER_WORKER * self.local_workers()))

    def cut_size(self, total: int) -> int:
        """The shard size for an input whose shards' outputs are kept as the artifact's parts: the configured one,
        else one from the input's size alone, never from the workers, so that the parts are the same whatever the
        engine and however many workers; at least CUT_SHARDS of them, for any cluster to balance."""
        if self.shard_bytes is not None:
            return self.shard_bytes
        return bounded_shard(total, CUT_SHARDS)

    def ray_address(self) -> str | None:
        """The cluster to join: the configured one, else RAY_ADDRESS; None starts a local one."""
        return self.address or os.environ.get("RAY_ADDRESS") or None

    def local_workers(self) -> int:
        return self.workers or usable_cpus()

    def processes_here(self) -> int:
        """The worker processes to start on this machine: the workers, but no more than its usable CPUs. The stages'
        work is CPU-bound, so more processes than CPUs only add memory (each holds its own libraries and shard)."""
        return min(self.local_workers(), usable_cpus())


def usable_cpus() -> int:
    """The CPUs this process may use (a container's or a job's share), not the host's."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return usable or 1
