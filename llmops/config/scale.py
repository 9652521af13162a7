"""Where and how robustly the train stage runs: the Prefect work pool whose worker takes it, where the machines of a
multi-node training meet, what each Ray Train worker holds (engine: ray), and how often a failed training is tried
again. None of it shapes the model: no stage key covers it (the train stage reads it unkeyed)."""

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


class RendezvousConfig(Section):
    """Where the machines of a multi-node training meet; each machine sets its own rank. Shapes nothing."""

    node_rank: int = Field(0, ge=0)
    main_address: str | None = None
    main_port: int = Field(29500, ge=1, le=65535)
    # host:port of a c10d rendezvous, instead of main_address/main_port
    endpoint: str | None = None
    # seconds each machine's launcher waits for all of train.nodes to join; past it the run ends in one line
    timeout: int = Field(600, ge=1)


class LaunchConfig(Section):
    # a Prefect work pool (e.g. gpu) whose worker trains instead of the flow's process; None: train in-process
    work_pool: str | None = None
    # seconds a worker of work_pool has to take the stage, then to start it (600): past it, the run ends in one line
    work_pool_wait: int = Field(600, ge=1)
    # where the machines of a multi-node training (train.nodes) meet
    rendezvous: RendezvousConfig = Field(default_factory=RendezvousConfig)
    # with engine ray: the Ray Train workers (train.nodes x train.processes of them), what each holds and how often a
    # failed worker group restarts from the last checkpoint
    ray: RayTrainConfig = Field(default_factory=RayTrainConfig)
    # retries of the train stage when it fails; each resumes from the last complete checkpoint
    retries: int = Field(0, ge=0)
