"""The speed levers of `train.speed`, resolved for the machine a training runs on and handed to the Trainer.

`auto` turns a lever on where it pays and is safe: on CUDA, never on CPU. Each is also a plain
switch, so that the GPU bench compares a run with and without it (bench/gpu_train_bench.py --set).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Any

from llmops.config.schema import TrainConfig
from llmops.models.modeling import HardwareError, base_of

log = logging.getLogger("llmops.train")


@dataclass(frozen=True)
class Levers:
    compile: str  # layers, model or none
    liger_kernel: bool
    fused_adamw: bool
    loader_workers: int = 0  # DataLoader worker processes per training process
    # pinned host memory and workers kept across epochs: on CUDA, where batches are copied to the device
    pinned: bool = False


def liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def resolve(config: TrainConfig, device: str, strategy: str, processes: int = 1) -> Levers:
    """What each lever is on this launch of `processes` training processes per machine: `auto` is on with CUDA
    (per-layer compile in one process or DDP only: the parameter hooks of ZeRO-3 and FSDP break or re-trace its
    graphs; Liger only where installed); `on` for Liger needs it installed."""
    speed, cuda = config.speed, device == "cuda"
    compile_mode = speed.compile
    if compile_mode == "auto":
        compile_mode = "layers" if cuda and strategy in ("none", "ddp") else "none"
    if speed.liger_kernel == "on" and not liger_installed():
        raise HardwareError("train.speed.liger_kernel=on needs liger-kernel (pip install liger-kernel, on a CUDA "
                            "machine); set it to auto or off")
    liger = speed.liger_kernel == "on" or (speed.liger_kernel == "auto" and cuda and liger_installed())
    fused = speed.fused_adamw == "on" or (speed.fused_adamw == "auto" and cuda)
    return Levers(compile=compile_mode, liger_kernel=liger, fused_adamw=fused,
                  loader_workers=loader_workers(config, cuda, processes), pinned=cuda)


def loader_workers(config: TrainConfig, cuda: bool, processes: int) -> int:
    """DataLoader workers per training process: as configured, or for auto none on CPU (the cores train) and on CUDA
    up to 4, leaving each training process a core of its own (the machine's cores shared by its processes)."""
    configured = config.speed.loader_workers
    if configured != "auto":
        return int(configured)
    if not cuda:
        return 0
    return max(1, min(4, (os.cpu_count() or 1) // max(processes, 1) - 1))


def trainer_arguments(levers: Levers) -> dict[str, Any]:
    """The Trainer's arguments the levers set (per-layer compile is applied to the model: compile_layers)."""
    return {"torch_compile": levers.compile == "model", "use_liger_kernel": levers.liger_kernel,
            "optim": "adamw_torch_fused" if levers.fused_adamw else "adamw_torch",
            # batches are collated in the workers; the training process only takes each one's figures out
            # (training/tally.py)
            "dataloader_num_workers": levers.loader_workers, "dataloader_pin_memory": levers.pinned,
            "dataloader_persistent_workers": levers.pinned and levers.loader_workers > 0}


def micro_batch_rows(config: TrainConfig, row_length: int, packing: bool) -> int:
    """Rows per micro-batch per device: train.speed.micro_batch_tokens' worth of packed rows, else train.batch_size."""
    budget = config.speed.micro_batch_tokens
    if budget is None or not packing:
        return config.batch_size
    return max(1, budget // max(row_length, 1))


def compile_layers(model: Any) -> int:
    """torch.compile each decoder layer in place (the modules a model never splits: its repeated blocks), so that
    one compiled graph serves every layer and the rest of the model (embeddings, head, loss) runs as it is. A 4-bit
    base is left alone (bitsandbytes' kernels break the graphs). Returns how many layers were compiled."""
    base = base_of(model)
    if getattr(base, "is_loaded_in_4bit", False):
        return 0
    names = set(getattr(base, "_no_split_modules", None) or ())
    layers = [module for module in base.modules() if type(module).__name__ in names]
    for layer in layers:
        layer.compile()
    log.info("torch.compile on each of %d %s", len(layers), " and ".join(sorted(names)) or "layers")
    return len(layers)
