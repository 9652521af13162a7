"""Training on a Ray cluster (engine: ray): the train.distributed strategy run by Ray Train's TorchTrainer.

Ray Train starts train.nodes x train.processes workers on the cluster's machines, sets up their
process group (gloo on CPU, NCCL on GPU) and, after a worker or its machine fails, restarts the group
from the last reported checkpoint (launch.ray.max_failures times). Each worker runs the same `fit`
torchrun's workers run, with the same DeepSpeed JSON or FSDP YAML, in a folder of its own on its
machine. Every checkpoint the Trainer saves is reported to Ray, which merges every worker's files of
it into one folder in train.checkpoint_dir (shared storage: a path every machine sees, or an S3 or
fsspec URL); the ledger of the samples trained travels with it. The last report holds the model
(every shard of it), the ledgers and rank 0's figures: the stage brings it into its folder, where it
is consolidated as after torchrun.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

from llmops.config.scale import RayTrainConfig
from llmops.config.schema import PipelineConfig, TrainConfig
from llmops.data.tokenize import TokenizeRecord
from llmops.io.files import hash_json
from llmops.pipeline.engine import start_ray
from llmops.store import workspace
from llmops.store.settings import storage_options
from llmops.training import checkpoints
from llmops.training.launch import LaunchError, LaunchPlan, TrainingFailedError
from llmops.training.session import FIGURES_FILE, Session, TrainFigures

log = logging.getLogger("llmops.train")

# the name of the last report, the one that holds the trained model
FINAL = "final"


def run_on_ray(config: PipelineConfig, tokenized: TokenizeRecord, session: Session) -> TrainFigures:
    """Train on the cluster and bring the model, the ledgers and the figures into the session's folder."""
    plan, folder = LaunchPlan(**session.plan), Path(session.folder)
    storage, filesystem = storage_of(config.train, folder)
    # first: a missing Ray or an unreachable cluster is one line
    start_ray(config.engine)
    # no address: the local cluster the run starts for itself (for its data stages, or here), of a fixed size
    check_room(config.launch.ray, plan, ours=not config.engine.ray_address())
    from ray.train import CheckpointConfig, FailureConfig, RunConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    # the workers read the tokenized artifact in the workspace: on several machines, one they share (as the data
    # stages' Ray tasks do)
    spec = {"config": config.as_dict(), "tokenized": tokenized.model_dump(mode="json"),
            "session": session.model_dump(mode="json"), "home": str(workspace.home())}
    # a rerun of the stage under the same name picks up the run's last checkpoint from the storage
    run = RunConfig(name=session.key or folder.name, storage_path=storage, storage_filesystem=filesystem,
                    failure_config=FailureConfig(max_failures=config.launch.ray.max_failures),
                    checkpoint_config=CheckpointConfig(num_to_keep=config.train.save_total_limit + 1))
    trainer = TorchTrainer(train_worker, train_loop_config=spec, scaling_config=scaling(config.launch.ray, plan),
                           torch_config=TorchConfig(backend="nccl" if plan.device == "cuda" else "gloo"),
                           run_config=run)
    log.info("training on Ray: %d workers (%s, %s)", plan.world_size, plan.strategy, plan.device)
    try:
        result = trainer.fit()
    except Exception as err:  # Ray's TrainingFailedError and its kinds: the workers' errors, one line
        raise TrainingFailedError(f"training on Ray failed: {failure(err)}") from None
    if result.checkpoint is None or Path(result.checkpoint.path).name != FINAL:
        raise TrainingFailedError("training on Ray ended without reporting the trained model")
    bring_home(result.checkpoint, folder)
    return TrainFigures.model_validate_json((folder / FIGURES_FILE).read_text())


def failure(err: Exception) -> str:
    """The first failed rank and the last line of its error (the tracebacks stay in Ray's worker logs)."""
    failures = getattr(err, "worker_failures", None) or {}
    if not failures:
        return " ".join(str(err).split())[:600]
    rank, cause = min(failures.items(), key=lambda item: item[0])
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    return f"rank {rank}: {lines[-1] if lines else type(cause).__name__} (full output in Ray's worker logs)"


def scaling(config: RayTrainConfig, plan: LaunchPlan) -> Any:
    """nodes x processes workers, each holding launch.ray's CPUs and (on GPU) GPUs."""
    from ray.train import ScalingConfig

    return ScalingConfig(num_workers=plan.world_size, use_gpu=plan.device == "cuda",
                         resources_per_worker=worker_resources(config, plan))


def worker_resources(config: RayTrainConfig, plan: LaunchPlan) -> dict[str, float]:
    gpus = config.gpus_per_worker if config.gpus_per_worker is not None else 1.0
    return {"CPU": config.cpus_per_worker, **({"GPU": gpus} if plan.device == "cuda" else {})}


def check_room(config: RayTrainConfig, plan: LaunchPlan, ours: bool) -> None:
    """Ray Train waits without end until every worker has a place. On a cluster this run started, whose size is
    fixed, a training that cannot fit is one line; on a cluster it joined, a line says it waits (an autoscaler may
    add machines, other jobs may end)."""
    import ray

    need = {name: amount for name, amount in worker_resources(config, plan).items() if amount > 0}
    alive = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    # each worker whole on one machine
    room = sum(min(int(held.get(name, 0) // amount) for name, amount in need.items()) for held in alive) if need \
        else plan.world_size
    if room >= plan.world_size:
        return
    each = ", ".join(f"{amount:g} {name}" for name, amount in need.items())
    total = ", ".join(f"{sum(held.get(name, 0) for held in alive):g} {name}" for name in need)
    short = (f"the Ray cluster has room for {room} of the {plan.world_size} training workers of {each} each "
             f"({len(alive)} machine(s), {total} in all)")
    if ours:
        raise LaunchError(f"{short}: lower launch.ray.cpus_per_worker, launch.ray.gpus_per_worker, train.processes "
                          "or train.nodes, or join a larger cluster with engine.address")
    log.warning("%s: Ray Train waits until machines join or free up", short)


def storage_of(config: TrainConfig, folder: Path) -> tuple[str, Any]:
    """Where Ray keeps the checkpoints: train.checkpoint_dir (a path or any fsspec URL), else the training folder,
    which only one machine sees."""
    if not config.checkpoint_dir:
        if config.nodes > 1:
            raise LaunchError(f"engine ray with train.nodes={config.nodes} keeps checkpoints in train.checkpoint_dir, "
                              "which every machine must reach: set it to a shared path or an S3 / fsspec URL")
        return str(folder / "ray"), None
    import fsspec
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    filesystem, root = fsspec.core.url_to_fs(config.checkpoint_dir, **storage_options(config.checkpoint_dir))
    if "file" in (filesystem.protocol if isinstance(filesystem.protocol, tuple) else (filesystem.protocol,)):
        return str(Path(root).resolve()), None
    return root, PyFileSystem(FSSpecHandler(filesystem))


def bring_home(checkpoint: Any, folder: Path) -> None:
    """The final report's files (model, ledgers, figures, trainer state) into the training folder."""
    landing = folder / ".ray-final"
    shutil.rmtree(landing, ignore_errors=True)
    checkpoint.to_directory(str(landing))
    for entry in landing.iterdir():
        target = folder / entry.name
        shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
        os.replace(entry, target)
    landing.rmdir()
    shutil.rmtree(folder / "ray", ignore_errors=True)  # the checkpoints of a one-machine run: the model is here now


def train_worker(spec: dict[str, Any]) -> None:
    """One Ray Train worker: its rank of the training, from the run's last checkpoint, its files reported back."""
    import ray.train

    from llmops.training import worker
    from llmops.training.trainer import fit

    os.environ["LLMOPS_HOME"] = spec["home"]
    config = PipelineConfig.model_validate(spec["config"])
    session = Session.model_validate(spec["session"])
    rank = ray.train.get_context().get_world_rank()
    scratch = scratch_folder(session, rank)
    resume = restore(ray.train.get_checkpoint(), scratch)
    worker.show_progress(rank)
    use_launch_file(LaunchPlan(**session.plan))
    session = session.model_copy(update={"folder": str(scratch), "resume_from": str(resume) if resume else None})
    figures = fit(config, TokenizeRecord.model_validate(spec["tokenized"]), session,
                  extra_callbacks=(reporting_checkpoints(scratch, rank),))
    report_final(scratch, figures, rank)


def scratch_folder(session: Session, rank: int) -> Path:
    """This worker's folder on its machine: one per training and rank, so that a restart here finds its ledger."""
    import tempfile

    training = hash_json({"folder": session.folder, "key": session.key})[:16]
    return Path(tempfile.gettempdir()) / "llmops-ray-train" / training / f"rank-{rank}"


def restore(checkpoint: Any, scratch: Path) -> Path | None:
    """The checkpoint Ray hands a restarted worker, as a Trainer checkpoint folder, with the ledgers trimmed to it;
    a first attempt starts from an empty folder."""
    from llmops.training.callbacks import trim_ledger

    if checkpoint is None:
        shutil.rmtree(scratch, ignore_errors=True)
        (scratch / "ledger").mkdir(parents=True)
        return None
    local = scratch / "checkpoints" / Path(checkpoint.path).name
    shutil.rmtree(scratch / "checkpoints", ignore_errors=True)
    checkpoint.to_directory(str(local))
    (scratch / "ledger").mkdir(parents=True, exist_ok=True)
    for path in (local / "ledger").glob("rank-*.jsonl"):
        os.replace(path, scratch / "ledger" / path.name)
    shutil.rmtree(local / "ledger", ignore_errors=True)
    trim_ledger(scratch / "ledger", checkpoints.step_of(local))
    log.info("resuming training from %s", local.name)
    return local


def linked_copy(source: Path, target: Path) -> None:
    """A folder's files under `target` without copying their bytes."""
    shutil.copytree(source, target, copy_function=os.link, dirs_exist_ok=True)


def reporting_checkpoints(scratch: Path, rank: int) -> Any:
    """A Trainer callback that reports each saved checkpoint, this worker's files of it and its ledger, to Ray."""
    from transformers import TrainerCallback

    class ReportCheckpoints(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            name = f"checkpoint-{state.global_step}"
            staged = scratch / "staged" / name
            shutil.rmtree(staged, ignore_errors=True)
            linked_copy(Path(args.output_dir) / name, staged)
            add_ledger(scratch, staged, rank)
            report(staged, name, {"step": state.global_step})

    return ReportCheckpoints()


def add_ledger(scratch: Path, staged: Path, rank: int) -> None:
    ledger = scratch / "ledger" / f"rank-{rank}.jsonl"
    if ledger.is_file():
        (staged / "ledger").mkdir(exist_ok=True)
        shutil.copy2(ledger, staged / "ledger" / ledger.name)


def report(staged: Path, name: str, metrics: dict[str, Any]) -> None:
    import ray.train

    ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(staged)), checkpoint_dir_name=name)
    shutil.rmtree(staged, ignore_errors=True)


def report_final(scratch: Path, figures: TrainFigures, rank: int) -> None:
    """The last report: this worker's part of the model (every shard, under FSDP or ZeRO-3), its ledger, and on rank 0
    the figures and the trainer's state."""
    staged = scratch / "staged" / FINAL
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    for part in ("model", "adapter"):
        if (scratch / part).is_dir():
            linked_copy(scratch / part, staged / part)
    add_ledger(scratch, staged, rank)
    if rank == 0:
        (staged / FIGURES_FILE).write_text(figures.model_dump_json())
        shutil.copy2(scratch / "trainer_state.json", staged / "trainer_state.json")
    report(staged, FINAL, {"step": figures.steps})
    shutil.rmtree(scratch, ignore_errors=True)


def use_launch_file(plan: LaunchPlan) -> None:
    """FSDP's settings from the same accelerate YAML `accelerate launch` reads, as the environment it would set;
    DeepSpeed's JSON goes to the Trainer's arguments as under torchrun."""
    if plan.strategy == "fsdp" and plan.config_file:
        os.environ.update(fsdp_environment(plan))


def fsdp_environment(plan: LaunchPlan) -> dict[str, str]:
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    arguments = launch_command_parser().parse_args(
        ["--config_file", str(plan.config_file), "--num_processes", str(plan.world_size), "--num_machines",
         str(plan.nodes), "--machine_rank", "0", "llmops-worker"])
    arguments, _, _ = _validate_launch_command(arguments)
    found = prepare_multi_gpu_env(arguments)
    return {name: value for name, value in found.items() if name.startswith(("FSDP_", "ACCELERATE_"))}
