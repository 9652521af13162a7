"""One training process: the selected objective's model, data and Trainer, trained from the resume point and saved.

The objective supplies what differs (objectives/: the model class and its head, the datasets, the
collator, the training arguments and the Trainer, TRL's SFTTrainer or DPOTrainer among them); here
is what every training shares: packing where the model passes the check, the callbacks (live figures,
the sample ledger, complete checkpoints, a clean stop on a signal, steady-state throughput), saving
without pickles or paths, and the figures.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmops.config.schema import PipelineConfig, TrainConfig
from llmops.data.tokenize import TokenizeRecord
from llmops.io.errors import UserError
from llmops.io.files import load_dataset_dir, write_text_synced
from llmops.models import modeling, precision
from llmops.objectives import selected
from llmops.objectives.base import Objective
from llmops.text import packing
from llmops.tracking import runs
from llmops.training import checkpoints, speed, throughput
from llmops.training.launch import LaunchPlan, TrainingInterrupted
from llmops.training.session import FIGURES_FILE, INTERRUPTED_FILE, Session, TrainFigures
from llmops.training.tally import Tally, watch

log = logging.getLogger("llmops.train")


def fit(pipeline: PipelineConfig, tokenized: TokenizeRecord, session: Session,
        extra_callbacks: tuple[Any, ...] = ()) -> TrainFigures:
    """One training process: build the model and Trainer, train from the resume point, save; rank 0's figures on
    every machine (each machine's first process writes them: a machine of a multi-node training reads its own)."""
    from llmops.training.callbacks import StopOnSignal

    trainer, tally, packed = build_trainer(pipeline, tokenized, session, extra_callbacks)
    ledger = Path(session.folder) / "ledger" / f"rank-{trainer.args.process_index}.jsonl"
    session = session.model_copy(update={"resume_from": checkpoints.agreed_resume(session.resume_from, ledger)})
    stop = next(c for c in trainer.callback_handler.callbacks if isinstance(c, StopOnSignal))
    started = time.perf_counter()
    initial_step = checkpoints.step_of(session.resume_from) if session.resume_from else 0
    # a worker leaves SIGTERM to its launcher (which uses it to tear the group down); alone, both signals stop
    signals = (2,) if LaunchPlan(**session.plan).world_size > 1 else (2, 15)
    with stop.listening(signals), runs.system_metrics(session.run, trainer.is_world_process_zero()), \
            training_errors(pipeline.train):
        trainer.train(resume_from_checkpoint=session.resume_from)
    seconds = time.perf_counter() - started
    folder = Path(session.folder)
    if stop.requested.is_set():
        message = (f"training stopped at step {trainer.state.global_step} and saved a checkpoint there; run the "
                   "same command again to resume")
        if trainer.is_local_process_zero():
            (folder / INTERRUPTED_FILE).write_text(json.dumps({"message": message}))
        raise TrainingInterrupted(message)
    save(trainer, load_tokenizer(tokenized.dir), pipeline, folder / "model")
    figures = shared_figures(summarize(trainer, tally, packed, seconds, session, tokenized, initial_step))
    if trainer.is_local_process_zero():
        write_text_synced(folder / FIGURES_FILE, figures.model_dump_json())
    return figures


def shared_figures(figures: TrainFigures) -> TrainFigures:
    """Rank 0's figures, on every process: those of the others differ in what they measured themselves (memory)."""
    import torch

    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return figures
    found = [figures.model_dump_json()]
    torch.distributed.broadcast_object_list(found, src=0)
    return TrainFigures.model_validate_json(found[0])


def build_trainer(pipeline: PipelineConfig, tokenized: TokenizeRecord, session: Session,
                  extra_callbacks: tuple[Any, ...] = ()) -> tuple[Any, Any, bool]:
    from transformers import EarlyStoppingCallback, PrinterCallback

    from llmops.training.callbacks import (
        CheckpointCallback,
        LedgerCallback,
        MetricsCallback,
        StopOnSignal,
        ThroughputCallback,
    )
    from llmops.training.faults import FaultCounter
    from llmops.training.nonfinite import NonfiniteGuard
    from llmops.training.pruning import pruning_callbacks

    config, model_config, objective = pipeline.train, pipeline.model, selected(pipeline.data)
    tokenizer = load_tokenizer(tokenized.dir)
    folder, plan = Path(session.folder), LaunchPlan(**session.plan)
    # the arguments come before the model: they start the process group and register a DeepSpeed config, so that
    # ZeRO-3 builds the model already partitioned (zero.Init) and FSDP's cpu_ram_efficient_loading reads the
    # weights on one process only, instead of every process holding the whole model
    arguments = objective.arguments(common_arguments(config, folder, config.packing and objective.packable,
                                                     plan, tokenized.figures.max_length), pipeline)
    # the load dtype is chosen, never the checkpoint's own (transformers' default): fp32 where weights train
    dtype = precision.load_dtype(training_precision(config), model_config.adapter, modeling.sharded_loading())
    model = objective.build_model(model_config, tokenizer, config.seed, pipeline.data.labels,
                                  quantize=model_config.adapter == "qlora", dtype=dtype)
    model.config.use_cache = False  # training never decodes; packed masks need it off
    packed = decide_packing(config, objective, model, tokenized.dir, tokenizer.pad_token_id)
    arguments.train_sampling_strategy = sampling_strategy(config, packed)
    # a fallback to unpacked rows trains train.batch_size rows, not the packed token budget's (DeepSpeed fixed its
    # micro-batch with the arguments)
    if packed != (config.packing and objective.packable) and not arguments.deepspeed:
        arguments.per_device_train_batch_size = speed.micro_batch_rows(config, tokenized.figures.max_length, packed)
    model = objective.with_adapter(model, model_config, config.gradient_checkpointing)
    if speed.resolve(config, plan.device, plan.strategy).compile == "layers":
        speed.compile_layers(model)
    max_length = tokenized.figures.max_length
    train_set, eval_set = objective.datasets(tokenized.dir, packed, max_length)
    meter = objective.meter(tokenizer, model, packed, max_length, config.seed)
    # the meter collates (in the loader's workers); the tally, here, keeps what the batches trained on held
    tally = Tally(meter)
    ledger = folder / "ledger" / f"rank-{arguments.process_index}.jsonl"
    guard = NonfiniteGuard(config.nonfinite, session.run, loss_falls=getattr(objective, "loss_falls", True))
    faults = FaultCounter(session.run)
    # the guard first: its count joins the figures MetricsCallback sends
    callbacks = [guard, MetricsCallback(session.run, prefix="train", padding=tally), LedgerCallback(tally, ledger),
                 CheckpointCallback(checkpoint_store(config, plan), session.key), StopOnSignal(),
                 ThroughputCallback(skip_steps=warmup_steps(config), meter=tally), faults, *extra_callbacks]
    if config.early_stopping_patience is not None:
        callbacks.append(EarlyStoppingCallback(early_stopping_patience=config.early_stopping_patience))
    # a sweep's trial reports its evaluation loss to its study, which may stop it (training/pruning.py)
    callbacks += pruning_callbacks(session.run.trial if session.run else None, plan.world_size)
    settings = {"args": arguments, "train_dataset": train_set, "eval_dataset": eval_set if config.eval_steps else None,
                "processing_class": tokenizer, "data_collator": meter, "callbacks": callbacks}
    trainer = objective.trainer(model, settings, model_config, tokenizer, config.seed)
    watch(trainer, tally)
    guard.attach(trainer)
    faults.attach(trainer)
    # progress goes to the run's log and MLflow through MetricsCallback, not to stdout
    trainer.remove_callback(PrinterCallback)
    return trainer, tally, packed


def checkpoint_store(config: TrainConfig, plan: LaunchPlan) -> str | None:
    """Where the checkpoint callback copies checkpoints: train.checkpoint_dir, except on Ray, where Ray Train keeps
    them there itself (ray_train.py)."""
    return None if plan.engine == "ray" else config.checkpoint_dir


def load_tokenizer(tokenized_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenized_dir / "tokenizer"))


def training_precision(config: TrainConfig) -> str:
    """bf16 where the GPU runs it natively (sm80 and newer), fp16 on older GPUs, fp32 on CPU."""
    return precision.compute_precision(config.precision, modeling.cuda_capability())


def precision_flags(config: TrainConfig) -> dict[str, bool]:
    return {name: training_precision(config) == name for name in ("bf16", "fp16")}


def common_arguments(config: TrainConfig, output_dir: Path, packed: bool, plan: LaunchPlan,
                     row_length: int = 0) -> dict[str, Any]:
    """The Trainer's arguments every objective shares; the objective picks the arguments class and adds its own.
    `row_length` is a packed row's width, for train.speed.micro_batch_tokens."""
    evaluating = config.eval_steps is not None
    return {
        "output_dir": str(output_dir / "checkpoints"),
        "num_train_epochs": config.epochs,
        "max_steps": config.max_steps,
        "per_device_train_batch_size": speed.micro_batch_rows(config, row_length, packed),
        "per_device_eval_batch_size": config.batch_size,
        "gradient_accumulation_steps": config.grad_accum,
        "learning_rate": config.learning_rate,
        "lr_scheduler_type": config.lr_scheduler,
        "warmup_steps": config.warmup_ratio,
        "weight_decay": config.weight_decay,
        "max_grad_norm": config.max_grad_norm,
        "gradient_checkpointing": config.gradient_checkpointing,
        "seed": config.seed,
        "logging_steps": config.logging_steps,
        "save_strategy": "steps",
        # checkpoints must fall on evaluations for the best model to be restorable
        "save_steps": config.eval_steps if evaluating else config.save_steps,
        "save_total_limit": config.save_total_limit,
        "eval_strategy": "steps" if evaluating else "no",
        "eval_steps": config.eval_steps,
        "load_best_model_at_end": config.early_stopping_patience is not None,
        "metric_for_best_model": "eval_loss",
        "greater_is_better": False,
        "train_sampling_strategy": sampling_strategy(config, packed),
        "length_column_name": "length",
        "report_to": [],
        "disable_tqdm": True,
        # real tokens are counted by the collator, on the host (training/tally.py, ThroughputCallback): the Trainer's
        # count would synchronise with the GPU at every micro-step; the loader's workers are a speed lever
        "include_num_input_tokens_seen": "no",
        # the filter reads every step's loss on the host (a GPU sync per step) to hide a non-finite one
        "logging_nan_inf_filter": False,
        # the datasets hold exactly the columns the collator reads
        "remove_unused_columns": False,
        **precision_flags(config),
        **distributed_arguments(config, plan),
    }


def sampling_strategy(config: TrainConfig, packed: bool) -> str:
    return "group_by_length" if config.group_by_length and not packed else "random"


def distributed_arguments(config: TrainConfig, plan: LaunchPlan) -> dict[str, Any]:
    """The Trainer's side of the launch: CPU processes join over gloo only with use_cpu (else each trains alone);
    DeepSpeed reads its JSON; FSDP comes from the accelerate launch environment."""
    arguments: dict[str, Any] = {"use_cpu": plan.device == "cpu",
                                 **speed.trainer_arguments(speed.resolve(config, plan.device, plan.strategy,
                                                                         plan.processes))}
    if plan.strategy == "deepspeed":
        arguments["deepspeed"] = plan.config_file
    if plan.strategy == "ddp":
        arguments["ddp_find_unused_parameters"] = False
    if plan.nodes > 1 and plan.engine == "local":
        # each machine started by its own launcher keeps its own checkpoints (Ray Train's report them); the weights
        # in them and in the model only global rank 0 writes, which is why the others resume from the checkpoint
        # store and keep rank 0's artifact (train.py, store/artifacts.py)
        arguments["save_on_each_node"] = True
    return arguments


class PackingError(UserError, RuntimeError):
    """Packing was asked for and the model does not keep packed samples apart, or the check could not tell."""


def decide_packing(config: TrainConfig, objective: Objective, model: Any, tokenized_dir: Path,
                   pad_token_id: int) -> bool:
    """Pack when configured and the objective reads one sequence per sample (a decoder): the model must give packed
    samples the same logits as separate ones, or the training stops in one line (train.packing_fallback: unpacked).
    A check that could not run (out of memory, a kernel that failed to compile) stops it in its own line, whatever
    the fallback. The check runs once, on the first process and its own device; every process gets its answer.
    Under FSDP or ZeRO-3 it is skipped (it would need the whole model on one GPU), and the log says so."""
    import torch

    if not config.packing or not objective.packable:
        return False
    attention = getattr(model.config, "_attn_implementation", "?")
    if modeling.sharded_loading():
        log.warning("packing check skipped: the weights are sharded (FSDP or ZeRO-3) and the check needs the whole "
                    "model on one GPU; packing trusts attention %s to keep samples apart by their position ids",
                    attention)
        return True
    train_set = load_dataset_dir(tokenized_dir / "train")
    samples = [row["input_ids"][:16] for row in train_set.select(range(min(3, len(train_set))))]
    half = getattr(torch, precision.half_dtype_name(modeling.cuda_capability()))  # as training computes on a GPU
    found = on_first_process(lambda: packing.check_packing(model, samples, pad_token_id, device=checking_device(),
                                                           half=half))
    if found.exact:
        return True
    name = type(model).__name__
    if found.failure is not None:
        raise PackingError(f"train.packing: the check that {name} (attention {attention}) keeps packed samples apart "
                           f"could not run: {found.failure}; set another model.attention, or train.packing: false")
    if not config.packing_fallback:
        raise PackingError(f"train.packing: {name} with attention {attention} does not keep packed samples apart "
                           f"({found.reason}); set train.packing: false, or train.packing_fallback: true to train "
                           "unpacked when this happens, or another model.attention")
    log.warning("packing is off (train.packing_fallback): %s does not keep packed samples apart (attention %s: %s)",
                name, attention, found.reason)
    return False


def checking_device() -> str:
    """The device this process trains on: its local rank's GPU (never cuda:0 in every rank), or the CPU."""
    import torch

    return modeling.local_device() if torch.cuda.is_available() else "cpu"


def on_first_process(compute: Callable[[], Any]) -> Any:
    """`compute` run by the first process only; every other process waits for its answer."""
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list

    state = PartialState()
    answer = [compute() if state.is_main_process else None]
    if state.use_distributed:
        broadcast_object_list(answer, from_process=0)
    return answer[0]


def warmup_steps(config: TrainConfig) -> int:
    """Steps left out of the steady-state throughput: compilation and allocator warm-up happen in them."""
    return max(1, min(10, config.max_steps // 5)) if config.max_steps > 0 else 10


class training_errors:  # noqa: N801 - a context manager, named like one
    """Out of GPU memory becomes one line naming the settings that lower memory."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: BaseException | None, trace: Any) -> None:
        import torch

        if isinstance(error, torch.OutOfMemoryError):
            raise modeling.HardwareError(
                f"out of GPU memory while training (train.batch_size={self.config.batch_size}, "
                f"train.grad_accum={self.config.grad_accum}, train.gradient_checkpointing="
                f"{str(self.config.gradient_checkpointing).lower()}): lower batch_size and raise grad_accum to keep "
                "the effective batch, or turn gradient_checkpointing on") from None


def save(trainer: Any, tokenizer: Any, pipeline: PipelineConfig, target: Path) -> None:
    """The weights (or the adapter, or the base with the adapter merged in), the tokenizer, the label order and
    the training arguments as JSON: no pickle, no absolute path (the same training gives the same bytes
    whichever workspace it ran in)."""
    model, model_config = trainer.model, pipeline.model
    merging = model_config.adapter != "none" and model_config.lora.merge
    if merging and merges_in_process(trainer, model_config.adapter):
        if trainer.args.should_save:
            model.save_pretrained(str(target.parent / checkpoints.ADAPTER_DIR))
            model.merge_and_unload().save_pretrained(str(target))
    else:
        # sharded or 4-bit, the adapter is saved beside the model and merged later onto a fresh base loaded whole and
        # unquantized (train.py's merge_saved_adapter)
        save_weights(trainer, target.parent / checkpoints.ADAPTER_DIR if merging else target)
    if not trainer.args.should_save:  # rank 0, or each machine's first process (save_on_each_node)
        return
    tokenizer.save_pretrained(str(target))
    (target / "training_args.bin").unlink(missing_ok=True)  # a pickle: the folder holds safetensors only
    (target / "training_args.json").write_text(json.dumps(portable_arguments(trainer.args), indent=2,
                                                          sort_keys=True))
    if pipeline.data.labels:
        modeling.save_labels(target, pipeline.data.labels)
    state = json.loads(json.dumps(dataclasses.asdict(trainer.state), default=str))
    if state.get("best_model_checkpoint"):
        state["best_model_checkpoint"] = Path(state["best_model_checkpoint"]).name
    (target.parent / "trainer_state.json").write_text(json.dumps(state, indent=2, sort_keys=True))


def merges_in_process(trainer: Any, adapter: str) -> bool:
    """Whether the trained model takes its adapter in here: not where each process holds a shard, nor into a 4-bit
    base (the merged weights would be requantized to NF4, the adapter's deltas rounded away)."""
    return adapter != "qlora" and not is_sharded(trainer)


def is_sharded(trainer: Any) -> bool:
    """Whether each process holds only part of the weights (FSDP, DeepSpeed ZeRO-3)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    return bool(trainer.is_fsdp_enabled) or (bool(trainer.is_deepspeed_enabled) and is_deepspeed_zero3_enabled())


def save_weights(trainer: Any, folder: Path) -> None:
    """The whole weights (or adapter) in one folder, every process taking part: FSDP's gathered once here whatever
    its checkpoints keep (sharded), ZeRO-3's 16-bit weights as the Trainer gathers them."""
    if trainer.is_fsdp_enabled:
        checkpoints.save_gathered(trainer.model, trainer.accelerator.unwrap_model(trainer.model), folder,
                                  trainer.args.should_save)
    else:
        trainer.save_model(str(folder))
    if trainer.args.should_save:
        (folder / "training_args.bin").unlink(missing_ok=True)  # a pickle: the folder holds safetensors only


def portable_arguments(arguments: Any) -> dict[str, Any]:
    """The Trainer's arguments without the fields that hold this machine's paths or say how it was launched."""
    values = json.loads(arguments.to_json_string())
    for field in ("output_dir", "logging_dir", "deepspeed", "hub_token", "push_to_hub_token", "save_on_each_node"):
        values.pop(field, None)
    return values


def training_loss(history: list[dict[str, Any]]) -> float:
    """The mean loss over all steps: each logged loss averages the steps since the one before."""
    total = weight = 0.0
    previous = 0
    for entry in history:
        steps = int(entry["step"]) - previous
        total += float(entry["loss"]) * steps
        weight += steps
        previous = int(entry["step"])
    return total / weight if weight else float("nan")


def summarize(trainer: Any, tally: Tally, packed: bool, seconds: float, session: Session, tokenized: TokenizeRecord,
              initial_step: int) -> TrainFigures:
    from llmops.training.callbacks import ThroughputCallback, peak_memory_mb

    plan = LaunchPlan(**session.plan)
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    evaluations = [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry]
    tokens = int(trainer.state.num_input_tokens_seen)  # restored from the checkpoint: the whole training's
    this_run = tokens - int(getattr(trainer, "_initial_num_input_tokens_seen", 0))
    clock = next(c for c in trainer.callback_handler.callbacks if isinstance(c, ThroughputCallback))
    steady_tokens, steady_seconds = clock.rate() or (this_run, seconds)
    # each sample attends to itself only (packed or padded): the attention length per sample, not the row's
    attention_length = tally.attention_length() or float(tokenized.figures.max_length)
    per_token = throughput.flops_per_token(trainer.model, attention_length)
    rates = throughput.throughput(steady_tokens, steady_seconds, per_token, plan.world_size)
    return TrainFigures(
        steps=int(trainer.state.global_step), epochs=float(trainer.state.epoch or 0),
        train_loss=training_loss(history), first_logged_loss=float(history[0]["loss"]) if history else None,
        last_logged_loss=float(history[-1]["loss"]) if history else None,
        best_eval_loss=min(evaluations) if evaluations else None, tokens=tokens, seconds=round(seconds, 2),
        tokens_per_s=rates["tokens_per_s"], **modeling.parameter_counts(trainer.model), packed=packed,
        padding_fraction=round(tally.padding_fraction(), 4), peak_memory_mb=peak_memory_mb(), strategy=plan.strategy,
        world_size=plan.world_size, resumed_from_step=initial_step,
        flops_per_token=per_token, attention_length=round(attention_length, 2), precision=trained_in(trainer.args),
        **precision.parameter_dtypes(trainer.model),
        tflops_per_device=rates["tflops_per_device"], peak_tflops=rates["peak_tflops"], mfu=rates["mfu"])


def trained_in(arguments: Any) -> str:
    return "bf16" if arguments.bf16 else "fp16" if arguments.fp16 else "fp32"
