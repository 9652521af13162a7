"""The Ray Train side of a launch, without a cluster: the plan, where checkpoints go, the FSDP file's settings; and
which machine of a multi-node training leads its build, and how the others build beside it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from llmops.config.scale import RayTrainConfig
from llmops.config.schema import PipelineConfig, TrainConfig, WorkspaceConfig
from llmops.io.errors import MissingInputError
from llmops.io.figures import Figures
from llmops.store import artifacts, workspace
from llmops.store.artifacts import StageRecord
from llmops.store.shared import FsspecStore
from llmops.training.launch import LaunchError, LaunchPlan, fingerprint, follower_rank, plan_launch
from llmops.training.ray_train import fsdp_environment, storage_of


def test_on_ray_the_workers_devices_come_from_the_ray_settings_and_the_engine_shapes_no_weight() -> None:
    cpu = plan_launch(TrainConfig(distributed="ddp", processes=1, nodes=2), "ray")
    assert (cpu.engine, cpu.device, cpu.world_size) == ("ray", "cpu", 2)
    gpu = plan_launch(TrainConfig(distributed="ddp", processes=4, nodes=2), "ray", RayTrainConfig(gpus_per_worker=1))
    assert (gpu.device, gpu.world_size) == ("cuda", 8)  # no GPU here: they are the cluster's
    local = plan_launch(TrainConfig(distributed="ddp", processes=1, nodes=2))
    assert local.engine == "local" and fingerprint(local) == fingerprint(cpu)
    assert plan_launch(TrainConfig(), "ray").engine == "local"  # one process trains in the stage's own


def test_checkpoints_go_to_checkpoint_dir_which_several_nodes_need(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="train.checkpoint_dir"):
        storage_of(TrainConfig(nodes=2), tmp_path)
    assert storage_of(TrainConfig(), tmp_path) == (str(tmp_path / "ray"), None)
    assert storage_of(TrainConfig(checkpoint_dir=f"file://{tmp_path}/store", nodes=2), tmp_path) == \
        (str(tmp_path / "store"), None)
    root, filesystem = storage_of(TrainConfig(checkpoint_dir="memory://bucket/checkpoints", nodes=2), tmp_path)
    assert root.endswith("bucket/checkpoints") and filesystem is not None


def test_fsdp_on_ray_reads_the_same_accelerate_file() -> None:
    plan = LaunchPlan("fsdp", 4, 2, "cuda", config_file="configs/accelerate/fsdp_full_shard.yaml", engine="ray")
    found = fsdp_environment(plan)
    assert (found["ACCELERATE_USE_FSDP"], found["FSDP_SHARDING_STRATEGY"]) == ("true", "FULL_SHARD")


def test_only_a_launcher_per_machine_has_followers() -> None:
    def config(rank: int, engine: str = "local", nodes: int = 2) -> PipelineConfig:
        return PipelineConfig.model_validate({"engine": engine, "train": {
            "distributed": "ddp", "processes": 1, "nodes": nodes}, "launch": {"rendezvous": {"node_rank": rank}}})

    assert [follower_rank(config(0)), follower_rank(config(1))] == [0, 1]
    assert follower_rank(config(1, engine="ray")) == 0 and follower_rank(config(0, nodes=1)) == 0


class Steps(Figures):
    steps: int


StepsRecord = StageRecord[Steps]


def test_a_follower_builds_without_the_lock_and_keeps_the_leaders_artifact(home: Path) -> None:
    def leader(folder: Path) -> Steps:
        (folder / "model.txt").write_text("weights")
        return Steps(steps=1)

    def follower(folder: Path) -> Steps:
        assert folder.name == "k.node-1.partial"
        # the leader holds the key's lock meanwhile, and finishes first
        with workspace.exclusive(home / "artifacts" / "train" / "k.lock"):
            (folder / "model.txt").write_text("weights")
        artifacts.build_artifact(StepsRecord, "train", "k", leader)
        return Steps(steps=1)

    record = artifacts.build_artifact(StepsRecord, "train", "k", follower, follower=1)
    assert record.reused and record.figures == Steps(steps=1)
    assert sorted(p.name for p in (home / "artifacts" / "train").iterdir()) == ["k", "k.lock"]
    with pytest.raises(MissingInputError, match=r"node rank 2\) took part, but the leading machine's"):
        artifacts.build_artifact(StepsRecord, "train", "j", leader, follower=2)  # no leader here, and no store
    left = {p.name for p in (home / "artifacts" / "train").iterdir() if p.name.startswith("j")}
    assert left == {"j.lock"}  # nor a copy of its own


def test_a_follower_waits_for_the_leader_as_long_as_the_workspace_says_then_stops_in_one_line(
        home: Path, tmp_path: Path) -> None:
    def follower(folder: Path) -> Steps:
        (folder / "model.txt").write_text("no weights: rank 0 alone saves them")
        return Steps(steps=1)

    started = time.monotonic()
    with artifacts.sharing(FsspecStore(str(tmp_path / "store")), wait_seconds=3.0), \
            pytest.raises(MissingInputError, match=r"it did not come within 0.05 min: check that node rank 0 runs "
                                                   r"with the same workspace.remote, or raise "
                                                   r"workspace.leader_wait_minutes$"):
        artifacts.build_artifact(StepsRecord, "train", "k", follower, follower=1)
    assert 3.0 <= time.monotonic() - started < 20
    assert WorkspaceConfig().leader_wait_minutes == 30 and artifacts.leader_wait.get() == 1800


def test_a_follower_on_a_disk_of_its_own_keeps_the_artifact_the_leader_publishes(
        home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def leader(folder: Path) -> Steps:
        (folder / "model.txt").write_text("weights")
        return Steps(steps=1)

    def follower(folder: Path) -> Steps:
        (folder / "model.txt").write_text("no weights: rank 0 alone saves them")
        monkeypatch.setenv("LLMOPS_HOME", str(tmp_path / "leader"))  # the leader's machine publishes its own
        artifacts.build_artifact(StepsRecord, "train", "k", leader)
        monkeypatch.setenv("LLMOPS_HOME", str(home))
        return Steps(steps=2)

    with artifacts.sharing(FsspecStore(str(tmp_path / "store"))):
        record = artifacts.build_artifact(StepsRecord, "train", "k", follower, follower=1)
    assert record.figures == Steps(steps=1) and (record.dir / "model.txt").read_text() == "weights"
    assert record.dir == home.resolve() / "artifacts" / "train" / "k"
