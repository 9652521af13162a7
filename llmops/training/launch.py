"""How a training runs: in this process, or as worker processes started by torchrun or accelerate launch.

The strategy asked for is the strategy run, or training stops before it starts with one line that
says why: `accelerate launch --cpu` starts a single process, the Trainer's FSDP on CPU silently runs
DDP, and its DeepSpeed path fails on a machine without CUDA, so none of those is ever let through.
DDP runs on CPU too (gloo). Worker output goes to a log file in the training folder; the stage log
gets the workers' progress lines; a failing rank is named in one line, its traceback in the file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from llmops.config.scale import RayTrainConfig, RendezvousConfig
from llmops.config.schema import PipelineConfig, TrainConfig
from llmops.io.errors import Interrupted, Transient, UserError
from llmops.io.figures import Compute
from llmops.io.files import hash_file, project_root
from llmops.models import modeling

log = logging.getLogger("llmops.train")

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# what a worker's progress lines start with, so the launcher can pass them on to the stage log
PROGRESS_MARK = "llmops-progress "
STOP_GRACE_SECONDS = 120


class LaunchError(UserError, RuntimeError):
    """Training cannot start as configured, or a worker failed: one line a person can act on."""


class TrainingFailedError(Transient, LaunchError):
    """A training that started ended in failure (a rank raised, was killed or lost its machine): launch.retries runs
    it again, from its last checkpoint."""


class TrainingInterrupted(Interrupted):
    """Training stopped on a signal after saving a checkpoint; running the same command resumes it."""


@dataclass(frozen=True)
class LaunchPlan:
    strategy: str  # none, ddp, fsdp or deepspeed
    processes: int  # per machine
    nodes: int
    device: str  # cuda or cpu
    # the DeepSpeed JSON or accelerate YAML the strategy runs with
    config_file: str | None = None
    # local: torchrun or accelerate launch on this machine (one launcher per machine); ray: Ray Train's workers
    engine: str = "local"

    @property
    def world_size(self) -> int:
        return self.processes * self.nodes

    @property
    def inline(self) -> bool:
        return self.strategy == "none"


def gpu_count() -> int:
    """The GPUs torch sees here; none without asking torch where the machine has no GPU device at all."""
    if not modeling.may_have_gpu():
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def plan_launch(config: TrainConfig, engine: str = "local", ray: RayTrainConfig | None = None) -> LaunchPlan:
    """The strategy and process count this machine runs `config` with, or a LaunchError saying why it cannot.
    On Ray the workers run on the cluster's machines: their GPUs are launch.ray.gpus_per_worker, not this machine's."""
    gpus = gpu_count()
    on_ray = engine == "ray"
    if on_ray:
        per_worker = ray.gpus_per_worker if ray is not None else None
        gpus = 0 if per_worker == 0 or (per_worker is None and not gpus) else max(gpus, 1)
    processes = (gpus or 1) if config.processes == "auto" else int(config.processes)
    strategy = config.distributed
    if strategy == "auto":
        strategy = "ddp" if processes * config.nodes > 1 else "none"
    if strategy == "none" and processes * config.nodes > 1:
        raise LaunchError(f"train.distributed=none trains in one process, but train.processes={processes} and "
                          f"train.nodes={config.nodes}: set train.distributed to ddp, fsdp or deepspeed")
    if gpus and processes > gpus and not on_ray:
        raise LaunchError(f"train.processes={processes} but this machine has {gpus} GPU(s)")
    if strategy in ("fsdp", "deepspeed"):
        check_sharding_prerequisites(strategy, gpus)
    device = "cuda" if gpus else "cpu"
    return LaunchPlan(strategy=strategy, processes=processes, nodes=config.nodes, device=device,
                      config_file=str(launch_config_file(config, strategy)) if strategy in ("fsdp", "deepspeed")
                      else None, engine="ray" if on_ray and strategy != "none" else "local")


def plan_for(config: PipelineConfig) -> LaunchPlan:
    """This machine's plan for the config's training, on the config's engine."""
    return plan_launch(config.train, config.engine.name, config.launch.ray)


def follower_rank(config: PipelineConfig) -> int:
    """This machine's node rank in a multi-node training whose launchers each machine starts (torchrun under Slurm or
    Kubernetes): above 0 it trains alongside the machine of rank 0, which holds the artifact's lock meanwhile."""
    if config.train.nodes == 1 or plan_for(config).engine == "ray":
        return 0
    return config.launch.rendezvous.node_rank


def devices_held(config: PipelineConfig) -> Compute:
    """What a training holds while it runs, what its build is costed at: a GPU per process of the launch plan (on
    every machine of a multi-node training), of this machine's model; on CPU, each machine's CPU, whatever number of
    processes share it."""
    import torch

    plan = plan_for(config)
    if plan.device == "cuda":
        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cuda"
        return Compute(device=name, devices=plan.world_size)
    return Compute(device="cpu", devices=plan.nodes)


def check_sharding_prerequisites(strategy: str, gpus: int) -> None:
    if not gpus:
        fallback = "runs plain DDP instead" if strategy == "fsdp" else "fails with a batch-size mismatch"
        raise LaunchError(f"train.distributed={strategy} needs CUDA GPUs and this machine has none (on CPU the "
                          f"Trainer's {strategy} {fallback}): use train.distributed=ddp or none here")
    if strategy == "deepspeed":
        try:
            import deepspeed  # noqa: F401
        except Exception as err:  # an import of deepspeed can fail in many ways (no CUDA toolkit, a broken build)
            raise LaunchError(f"train.distributed=deepspeed needs a working deepspeed install: {err}") from None


def launch_config_file(config: TrainConfig, strategy: str) -> Path:
    """The user's file, or the shipped one the options choose."""
    if config.launch_config:
        path = Path(config.launch_config)
        path = path if path.is_absolute() else project_root() / path
        if not path.is_file():
            raise LaunchError(f"train.launch_config: no such file: {path}")
        return path
    if strategy == "deepspeed":
        offload = {"none": "", "optimizer": "_offload_optimizer", "optimizer_and_parameters": "_offload"}
        return CONFIGS / "deepspeed" / f"zero{config.zero_stage}{offload[config.offload]}.json"
    return CONFIGS / "accelerate" / f"fsdp_{config.fsdp_sharding}_shard.yaml"


def fitted_to_adapter(plan: LaunchPlan, config: TrainConfig, adapter: str) -> LaunchPlan:
    """QLoRA under FSDP runs the FSDP-QLoRA recipe's file (FSDP1: FSDP2 would shard 4-bit weights as plain tensors),
    unless train.launch_config names the user's own."""
    if plan.strategy != "fsdp" or adapter != "qlora" or config.launch_config:
        return plan
    return replace(plan, config_file=str(CONFIGS / "accelerate" / "fsdp_qlora.yaml"))


def fingerprint(plan: LaunchPlan) -> dict[str, Any]:
    """What of the launch shapes the trained weights: strategy, world size, device, and the launch file's content."""
    found = asdict(plan)
    found.pop("engine")  # Ray Train's DDP is torchrun's: the engine shapes no weight
    found["config_file"] = hash_file(Path(plan.config_file)) if plan.config_file else None
    return found


# the module each launched process runs (training/worker.py)
WORKER_MODULE = "llmops.training.worker"


def command(plan: LaunchPlan, meet: RendezvousConfig, spec: Path, module: str = WORKER_MODULE) -> list[str]:
    """torchrun for DDP and DeepSpeed (the Trainer reads the DeepSpeed file); accelerate launch for FSDP."""
    worker = ["-m", module, str(spec)]
    if plan.strategy == "fsdp":
        where = ["--machine_rank", str(meet.node_rank), "--main_process_port", str(meet.main_port)]
        where += ["--main_process_ip", meet.main_address] if meet.main_address else []
        where += ["--rdzv_conf", f"timeout={meet.timeout}"] if plan.nodes > 1 else []
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(plan.config_file),
                "--num_processes", str(plan.world_size), "--num_machines", str(plan.nodes), *where, *worker]
    if plan.nodes == 1 and not meet.endpoint:
        where = ["--standalone"]
    elif meet.endpoint:
        where = ["--nnodes", str(plan.nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", meet.endpoint,
                 "--rdzv-id", spec.parent.name, "--node-rank", str(meet.node_rank), "--rdzv-conf",
                 f"join_timeout={meet.timeout}"]
    else:
        where = ["--nnodes", str(plan.nodes), "--node-rank", str(meet.node_rank), "--master-addr",
                 meet.main_address or "127.0.0.1", "--master-port", str(meet.main_port), "--rdzv-conf",
                 f"timeout={meet.timeout}"]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(plan.processes), *where, *worker]


def run_workers(plan: LaunchPlan, meet: RendezvousConfig, spec: Path, folder: Path,
                module: str = WORKER_MODULE) -> None:
    """Start the workers, pass their progress on, stop them cleanly on a signal, and say which rank failed."""
    logs = folder / "logs"
    logs.mkdir(exist_ok=True)
    for stale in logs.glob("error-rank-*.json"):
        stale.unlink()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if plan.nodes > 1 and plan.engine == "local":
        log.info("node rank %d of %d: waiting up to %d s for the other machines at %s (launch.rendezvous)",
                 meet.node_rank, plan.nodes, meet.timeout, meeting_point(meet))
    begun = (logs / "workers.log").stat().st_size if (logs / "workers.log").exists() else 0
    with (logs / "workers.log").open("a", encoding="utf-8") as record:
        process = subprocess.Popen(command(plan, meet, spec, module), stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, errors="replace", env=env,
                                   start_new_session=True)
        with forwarding_signals(process):
            for line in process.stdout or ():
                record.write(line)
                if line.startswith(PROGRESS_MARK):
                    log.info("%s", line[len(PROGRESS_MARK):].rstrip())
            code = process.wait()
    if code != 0:
        with (logs / "workers.log").open("rb") as record:
            record.seek(begun)
            output = record.read().decode("utf-8", "replace")
        raise TrainingFailedError(failure(logs, code, unmet(plan, meet, output)))


def meeting_point(meet: RendezvousConfig) -> str:
    return meet.endpoint or f"{meet.main_address or '127.0.0.1'}:{meet.main_port}"


# what torchrun's agent raises when the machines of a multi-node training do not all meet in time
UNMET = ("DistStoreError", "DistNetworkError", "RendezvousTimeoutError")


def unmet(plan: LaunchPlan, meet: RendezvousConfig, output: str) -> str | None:
    """Why a multi-node launch ended before any worker started, when the machines never all met; else None."""
    if plan.nodes == 1 or "rendezvous" not in output or not any(mark in output for mark in UNMET):
        return None
    return (f"the {plan.nodes} machines of train.nodes did not all meet at {meeting_point(meet)} within "
            f"{meet.timeout} s (this one is node rank {meet.node_rank}): start the same "
            "run on every machine, each with its own launch.rendezvous.node_rank and a main_address all of them reach")


def failure(logs: Path, code: int, unmet_nodes: str | None = None) -> str:
    """One line: the first rank that failed and its error (the traceback stays in the log)."""
    errors = sorted((json.loads(p.read_text()) for p in logs.glob("error-rank-*.json")), key=lambda e: e["time"])
    where = f"full output in {logs / 'workers.log'}"
    if not errors and unmet_nodes:
        return f"{unmet_nodes}; {where}"
    if not errors:
        return f"training workers exited with code {code} before reporting an error; {where}"
    first = errors[0]
    return f"training failed on rank {first['rank']}: {first['message']} ({where})"


class forwarding_signals:  # noqa: N801 - used as a context manager, named like one
    """SIGINT or SIGTERM to the launcher asks the workers (not their launcher) to stop after the current step;
    past the grace period the whole process group is killed, so no worker outlives the run.

    The handler only forwards the signal and wakes a watcher thread, which says so and keeps the deadline: a
    handler runs between two bytecodes of whatever the main thread was doing, which is often logging a worker's
    line, and a log call from it would wait for ever on the lock that interrupted call holds (Prefect's API log
    handler takes one that is not reentrant)."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process
        self.previous: dict[int, Any] = {}
        self.heard: str | None = None  # the first signal, which the watcher says
        self.asked = threading.Event()
        self.watcher = threading.Thread(target=self.watch, daemon=True)

    def __enter__(self) -> forwarding_signals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self.stop)
            self.watcher.start()
        return self

    def stop(self, signum: int, frame: Any) -> None:
        import psutil

        self.heard = self.heard or signal.Signals(signum).name
        with contextlib.suppress(psutil.Error):  # the workers ended meanwhile
            for child in psutil.Process(self.process.pid).children(recursive=True):
                child.send_signal(signal.SIGINT)
        self.asked.set()

    def watch(self) -> None:
        """Once a signal came: say so, and kill the group if it has not ended within the grace period."""
        self.asked.wait()
        if not self.heard:  # the training ended without one
            return
        log.warning("%s: asking the training workers to stop after this step, with a checkpoint", self.heard)
        try:
            self.process.wait(timeout=STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if self.process.poll() is None:
            self.kill()
            self.process.wait()
        self.asked.set()  # the watcher ends, if no signal woke it
