"""Training beyond one machine: Ray Train DDP across a Ray cluster of two nodes on this machine (gloo), restarted
from its last checkpoint after a worker is killed, and torchrun across two "nodes" (one launcher per node rank)
sharing one workspace, or only workspace.remote and train.checkpoint_dir on S3 (moto's server), killed and rerun.
All train the same model."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file

from llmops.config.scale import RayTrainConfig
from llmops.data.synthetic import instruction_records
from llmops.io.files import write_jsonl
from llmops.objectives import load_config
from llmops.pipeline.runner import build_stage
from llmops.training.launch import LaunchError, LaunchPlan
from llmops.training.ray_train import check_room
from tests.helpers import workspace_at

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
# world size 2 (two nodes, one process each), a checkpoint every 4 steps
SETTINGS = ["train.max_steps=12", "train.batch_size=4", "train.save_steps=4", "train.logging_steps=4",
            "train.save_total_limit=2", "tokenize.max_length=48", "train.distributed=ddp", "train.nodes=2",
            "train.processes=1"]
KILL_STEP = 6

# loaded by every Ray worker: when the kill file exists, rank 1 dies by SIGKILL after step KILL_STEP, once Ray has
# registered the checkpoint before it (the file names the storage), and removes the file
KILLER = textwrap.dedent(f"""
    import glob, importlib.abc, importlib.util, os, signal, sys, time

    def registered(storage, name):
        deadline = time.time() + 180
        while time.time() < deadline:
            for snapshot in glob.glob(os.path.join(storage, "*", "checkpoint_manager_snapshot.json")):
                if name in open(snapshot).read():
                    return
            time.sleep(0.5)

    def patch(module):
        original = module.LedgerCallback.on_step_end
        def on_step_end(self, args, state, control, **kwargs):
            result = original(self, args, state, control, **kwargs)
            trigger = os.environ.get("LLMOPS_TEST_KILL_FILE", "")
            if state.global_step == {KILL_STEP} and os.environ.get("RANK") == "1" and os.path.exists(trigger):
                registered(open(trigger).read(), "checkpoint-4")
                os.unlink(trigger)
                os.kill(os.getpid(), signal.SIGKILL)
            return result
        module.LedgerCallback.on_step_end = on_step_end

    class Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "llmops.training.callbacks":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            load = spec.loader.exec_module
            def exec_module(module):
                load(module)
                patch(module)
            spec.loader.exec_module = exec_module
            return spec

    if os.environ.get("LLMOPS_TEST_KILL_FILE"):
        sys.meta_path.insert(0, Hook())
""")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("multinode")
    write_jsonl(folder / "d.jsonl", instruction_records(rows=120, seed=5))
    (folder / "hooks").mkdir()
    (folder / "hooks" / "sitecustomize.py").write_text(KILLER)
    return folder


@pytest.fixture(scope="module")
def cluster(data: Path) -> Iterator[str]:
    """Two Ray nodes (two raylets) of one CPU each; their workers load the kill hook."""
    import ray
    from ray.cluster_utils import Cluster

    saved = {name: os.environ.get(name) for name in ("PYTHONPATH", "LLMOPS_TEST_KILL_FILE")}
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(data / "hooks"), saved["PYTHONPATH"]]))
    os.environ["LLMOPS_TEST_KILL_FILE"] = str(data / "kill-rank-1")
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    nodes.add_node(num_cpus=1)
    nodes.wait_for_nodes()
    ray.init(address=nodes.address, log_to_driver=False)
    try:
        yield nodes.address
    finally:
        ray.shutdown()
        nodes.shutdown()
        for name, value in saved.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)


def train_on_ray(home: Path, data: Path, address: str, *extra: str) -> dict:
    """The data stages here, the train stage on the cluster; the train record as JSON."""
    with workspace_at(home):
        config = load_config("configs/tiny_sft_cpu.yaml", [f"data.path={data / 'd.jsonl'}", *SETTINGS, *extra])
        deduped = build_stage("dedup", config, build_stage("validate", config, build_stage("ingest", config)))
        tokenized = build_stage("tokenize", config, deduped)
        on_ray = config.model_copy(update={"engine": config.engine.model_copy(update={"name": "ray",
                                                                                       "address": address})})
        return json.loads(build_stage("train", on_ray, tokenized).model_dump_json())


def weights(home: Path, record: dict) -> dict:
    return load_file(str(home / "artifacts" / "train" / record["key"] / "model" / "model.safetensors"))


@pytest.fixture(scope="module")
def on_ray(tmp_path_factory: pytest.TempPathFactory, data: Path, cluster: str) -> tuple[Path, dict, Path]:
    """A training on the cluster whose rank 1 is killed after step 6, with one restart allowed."""
    home, store = tmp_path_factory.mktemp("ray") / "home", tmp_path_factory.mktemp("ray-store")
    (data / "kill-rank-1").write_text(str(store))
    record = train_on_ray(home, data, cluster, f"train.checkpoint_dir={store}", "launch.ray.max_failures=1")
    return home, record, store


def test_ray_train_ddp_across_two_nodes_restarts_a_killed_worker_and_trains_the_model_into_the_artifact(
        on_ray: tuple[Path, dict, Path], data: Path) -> None:
    home, record, store = on_ray
    assert not (data / "kill-rank-1").exists()  # rank 1 was killed after step 6
    figures = record["figures"]
    # the restarted group resumed from the last checkpoint reported before the kill
    assert (figures["strategy"], figures["world_size"], figures["steps"], figures["resumed_from_step"]) == \
        ("ddp", 2, 12, 4)
    folder = home / "artifacts" / "train" / record["key"]
    assert {path.name for path in (folder / "ledger").glob("*.jsonl")} == {"rank-0.jsonl", "rank-1.jsonl"}
    steps = [json.loads(line)["step"] for line in (folder / "ledger" / "rank-1.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13))  # the steps after the checkpoint are not counted twice
    assert (folder / "model" / "model.safetensors").is_file() and (folder / "model" / "tokenizer.json").is_file()
    assert not (folder / "checkpoints").exists() and not (folder / "figures.json").exists()
    assert not any(store.iterdir())  # the finished training's checkpoints are gone from the storage


def test_a_training_the_cluster_has_no_room_for_is_one_line_or_a_warning(cluster: str,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Ray Train would wait without end for room for every worker: on a cluster the run started (fixed) that is one
    line before any worker starts; on a cluster it joined (an autoscaler may add machines), a warning."""
    plan = LaunchPlan("ddp", 1, 2, "cpu", engine="ray")
    wide = RayTrainConfig(cpus_per_worker=1.5)
    short = "the Ray cluster has room for 0 of the 2 training workers of 1.5 CPU each (2 machine(s), 2 CPU in all)"
    with pytest.raises(LaunchError) as raised:
        check_room(wide, plan, ours=True)
    assert str(raised.value).startswith(f"{short}: lower launch.ray.cpus_per_worker")
    with caplog.at_level(logging.WARNING, logger="llmops.train"):
        check_room(wide, plan, ours=False)
    assert caplog.messages == [f"{short}: Ray Train waits until machines join or free up"]
    check_room(RayTrainConfig(), plan, ours=True)  # one CPU each fits


# one machine's launcher: the stages up to train, the way the flow runs them; prints the train record
DRIVER = textwrap.dedent("""
    import json, logging, sys
    logging.basicConfig(level=logging.INFO)
    from llmops.cli.environment import configure_environment
    configure_environment()
    from llmops.pipeline.runner import build_stage
    from llmops.objectives import load_config
    config = load_config("configs/tiny_sft_cpu.yaml", json.loads(sys.argv[1]))
    deduped = build_stage("dedup", config, build_stage("validate", config, build_stage("ingest", config)))
    record = build_stage("train", config, build_stage("tokenize", config, deduped))
    print("RECORD " + record.model_dump_json())
""")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def torchrun(tmp_path_factory: pytest.TempPathFactory, data: Path) -> tuple[Path, list[dict]]:
    """Two launchers, node ranks 0 and 1, sharing one workspace; each one's train record."""
    home, port = tmp_path_factory.mktemp("torchrun") / "home", free_port()
    overrides = [f"data.path={data / 'd.jsonl'}", *SETTINGS, "launch.rendezvous.main_address=127.0.0.1",
                 f"launch.rendezvous.main_port={port}"]
    env = {name: value for name, value in os.environ.items() if name != "LLMOPS_TEST_KILL_FILE"}
    launchers = [subprocess.Popen([sys.executable, "-c", DRIVER,
                                   json.dumps([*overrides, f"launch.rendezvous.node_rank={rank}"])],
                                  cwd=REPO, env={**env, "LLMOPS_HOME": str(home)}, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [""] * 2

    def read(rank: int) -> None:
        outputs[rank] = launchers[rank].communicate(timeout=400)[0]

    readers = [threading.Thread(target=read, args=(rank,)) for rank in (0, 1)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    records = []
    for launcher, output in zip(launchers, outputs, strict=True):
        assert launcher.returncode == 0, output[-4000:]
        records.append(json.loads(next(line for line in output.splitlines() if line.startswith("RECORD "))[7:]))
    return home, records


def test_torchrun_across_two_nodes_sharing_a_workspace_finishes_and_both_read_the_figures(
        torchrun: tuple[Path, list[dict]]) -> None:
    home, records = torchrun
    assert records[0]["figures"] == records[1]["figures"] and records[0]["hash"] == records[1]["hash"]
    assert (records[0]["figures"]["strategy"], records[0]["figures"]["world_size"]) == ("ddp", 2)
    assert not list((home / "artifacts" / "train").glob("*.node-*"))  # the second node kept the first's artifact


def test_ray_train_and_torchrun_train_the_same_model(on_ray: tuple[Path, dict, Path],
                                                     torchrun: tuple[Path, list[dict]]) -> None:
    """The restarted Ray training's weights and figures are the uninterrupted torchrun training's (and the engine,
    placement, changes no key: tests/unit/test_stage_contract.py)."""
    ray_home, on_cluster, _ = on_ray
    home, records = torchrun
    mine, theirs = weights(ray_home, on_cluster), weights(home, records[0])
    assert max(float((mine[name] - tensor).abs().max()) for name, tensor in theirs.items()) <= 1e-6
    for figure in ("steps", "tokens", "world_size", "strategy"):
        assert on_cluster["figures"][figure] == records[0]["figures"][figure], figure
    assert abs(on_cluster["figures"]["train_loss"] - records[0]["figures"]["train_loss"]) <= 1e-4


# the two machines below share an S3 bucket (moto's server): built artifacts in one prefix, checkpoints in another
REMOTE, CHECKPOINTS = "s3://team/artifacts", "s3://team/checkpoints"
STOP_STEP = 5
# one machine's launcher as the flow runs it: each stage on its upstream records, with workspace.remote in effect
FLOW_DRIVER = textwrap.dedent("""
    import json, logging, sys
    logging.basicConfig(level=logging.INFO)
    from llmops.cli.environment import configure_environment
    configure_environment()
    from llmops.pipeline.runner import run_stage
    from llmops.objectives import load_config
    config = load_config("configs/tiny_sft_cpu.yaml", json.loads(sys.argv[1]))
    record = run_stage("ingest", config, [])
    for name in ("validate", "dedup", "tokenize", "train"):
        record = run_stage(name, config, [record])
    print("RECORD " + record.model_dump_json())
""")
# loaded by every training process: when its machine's stop file exists, the process dies by SIGKILL after step
# STOP_STEP (checkpoint-4 is complete and in the store by then), and the file goes
STOPPER = textwrap.dedent(f"""
    import os, signal
    if os.environ.get("LLMOPS_TEST_STOP_FILE") and "LOCAL_RANK" in os.environ:
        from llmops.training import callbacks
        original = callbacks.LedgerCallback.on_step_end
        def on_step_end(self, args, state, control, **kwargs):
            result = original(self, args, state, control, **kwargs)
            trigger = os.environ["LLMOPS_TEST_STOP_FILE"]
            if state.global_step == {STOP_STEP} and os.path.exists(trigger):
                os.unlink(trigger)
                os.kill(os.getpid(), signal.SIGKILL)
            return result
        callbacks.LedgerCallback.on_step_end = on_step_end
""")


@pytest.fixture(scope="module")
def bucket() -> Iterator[dict[str, str]]:
    """The bucket on a moto server on loopback; the environment that reaches it (the endpoint as an MLflow-on-S3
    team sets it)."""
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
           "MLFLOW_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    boto3.client("s3", endpoint_url=env["MLFLOW_S3_ENDPOINT_URL"], region_name="us-east-1", aws_access_key_id="test",
                 aws_secret_access_key="test").create_bucket(Bucket="team")
    yield env
    server.stop()


def objects(bucket: dict[str, str], prefix: str) -> set[str]:
    import boto3

    client = boto3.client("s3", endpoint_url=bucket["MLFLOW_S3_ENDPOINT_URL"], region_name="us-east-1",
                          aws_access_key_id="test", aws_secret_access_key="test")
    return {o["Key"] for o in client.list_objects_v2(Bucket="team", Prefix=prefix).get("Contents", [])}


def run_machines(homes: list[Path], data: Path, bucket: dict[str, str], stop: bool) -> list[tuple[int, str]]:
    """Both machines' launchers at once (node ranks 0 and 1), each in its own workspace; exit codes and output. With
    `stop`, every training process dies after step STOP_STEP."""
    overrides = [f"data.path={data / 'd.jsonl'}", *SETTINGS, "launch.rendezvous.main_address=127.0.0.1",
                 f"launch.rendezvous.main_port={free_port()}", f"workspace.remote={REMOTE}",
                 f"train.checkpoint_dir={CHECKPOINTS}"]
    base = {name: value for name, value in os.environ.items()
            if name not in ("LLMOPS_TEST_KILL_FILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")}
    hooks = data / "stop-hooks"
    hooks.mkdir(exist_ok=True)
    (hooks / "sitecustomize.py").write_text(STOPPER)
    launchers = []
    for rank, home in enumerate(homes):
        env = {**base, **bucket, "LLMOPS_HOME": str(home)}
        if stop:
            (data / f"stop-node-{rank}").write_text("")
            env["LLMOPS_TEST_STOP_FILE"] = str(data / f"stop-node-{rank}")
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hooks), base.get("PYTHONPATH")]))
        launchers.append(subprocess.Popen([sys.executable, "-c", FLOW_DRIVER,
                                           json.dumps([*overrides, f"launch.rendezvous.node_rank={rank}"])],
                                          cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
    outputs = [""] * len(launchers)

    def read(rank: int) -> None:
        outputs[rank] = launchers[rank].communicate(timeout=400)[0]

    readers = [threading.Thread(target=read, args=(rank,)) for rank in range(len(launchers))]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    return [(launcher.returncode, output) for launcher, output in zip(launchers, outputs, strict=True)]


def train_record(output: str) -> dict:
    return json.loads(next(line for line in output.splitlines() if line.startswith("RECORD "))[7:])


def test_torchrun_across_two_nodes_with_their_own_workspaces_syncs_through_s3_and_a_rerun_resumes(
        tmp_path: Path, data: Path, bucket: dict[str, str], torchrun: tuple[Path, list[dict]]) -> None:
    """Two machines that share only workspace.remote and train.checkpoint_dir (S3): the first run dies after step 5;
    the rerun, with the second machine on a fresh disk, takes the data and checkpoint-4 from S3, resumes there and
    trains the model an uninterrupted run trains."""
    first = [tmp_path / "node-0" / "home", tmp_path / "node-1" / "home"]
    stopped = run_machines(first, data, bucket, stop=True)
    assert all(code != 0 for code, _ in stopped), [output[-3000:] for _, output in stopped]
    saved = {tuple(key.split("/")[1:3]) for key in objects(bucket, "checkpoints/") if key.endswith("/manifest.json")}
    assert len(saved) == 1 and next(iter(saved))[1] == "checkpoint-4", saved  # the one before the kill, whole
    # whole: rank 0's weights and every machine's own part (each process's RNG state)
    stored = {key.rpartition("/")[2] for key in objects(bucket, "checkpoints/")}
    assert {"model.safetensors", "rng_state_0.pth", "rng_state_1.pth", "manifest.json"} <= stored, stored

    again = [first[0], tmp_path / "node-1-fresh" / "home"]  # the second machine lost its disk
    results = run_machines(again, data, bucket, stop=False)
    for code, output in results:
        assert code == 0, output[-4000:]
    records = [train_record(output) for _, output in results]
    assert records[0]["key"] == next(iter(saved))[0]  # the same training (the code did not change in between)
    assert records[0]["figures"] == records[1]["figures"] and records[0]["hash"] == records[1]["hash"]
    figures = records[0]["figures"]
    assert (figures["strategy"], figures["world_size"], figures["steps"], figures["resumed_from_step"]) == \
        ("ddp", 2, 12, 4), [output[-3000:] for _, output in results]
    fresh, key = results[1][1], records[0]["key"]
    assert re.search(r"tokenize artifact \w+ pulled from the shared store", fresh)  # the data, from workspace.remote
    assert "resuming from checkpoint-4 in the checkpoint store" in fresh  # the checkpoint, from checkpoint_dir
    assert "resuming training from checkpoint-4" in results[0][1]  # the first machine's own copy
    # the first machine published the model, the second kept that one; the training's checkpoints are gone
    assert f"train artifact {key} pulled from the shared store" in fresh
    for home in again:
        assert sorted(p.name for p in (home / "artifacts" / "train").iterdir() if p.name.startswith(key)) == \
            [key, f"{key}.lock"]
    assert f"artifacts/train/{key}/record.json" in objects(bucket, "artifacts/train/")
    assert not objects(bucket, "checkpoints/")
    home, uninterrupted = torchrun
    mine, theirs = weights(again[1], records[1]), weights(home, uninterrupted[0])
    assert max(float((mine[name] - tensor).abs().max()) for name, tensor in theirs.items()) <= 1e-6
