"""Train: HF Trainer (causal LM, classification) or TRL's SFTTrainer (instruction, chat) on the tokenized cache.

The model is built from the config with random init, or loaded with `from_pretrained`; full
fine-tuning or a LoRA / QLoRA adapter. Samples are packed padding-free where the model passes
the packing check. One process trains here; DDP, FSDP and DeepSpeed run as worker processes
started by a real launcher (llmops/training/launch.py), each running `fit` below. Work happens in a
resumable folder: a run that dies resumes from its last complete checkpoint (here, or in the
checkpoint store), every sample trained on is written to a ledger per optimizer step, and the
folder is renamed into place only once the final weights are saved, without pickles or paths.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from llmops.core import keys, tracking, workspace
from llmops.core.config import ModelConfig, PipelineConfig, RecordKind, TrainConfig
from llmops.core.tracking import RunHandle
from llmops.core.workspace import Figures, StageRecord
from llmops.data.tokenize import TokenizeRecord
from llmops.models import modeling
from llmops.objectives import dpo, masked_lm, seq2seq, token_classification
from llmops.registry import registered_base
from llmops.text import packing
from llmops.training import checkpoints, launch, throughput
from llmops.training.launch import LaunchPlan, TrainingInterrupted

log = logging.getLogger("llmops.train")

SPEC_FILE, FIGURES_FILE, INTERRUPTED_FILE = "launch-spec.json", "figures.json", "interrupted.json"


class TrainFigures(Figures):
    steps: int
    epochs: float
    # the mean loss over every optimizer step, read from the log history (a resumed training included)
    train_loss: float
    first_logged_loss: float | None
    last_logged_loss: float | None
    best_eval_loss: float | None
    tokens: int
    seconds: float
    # real (non-pad) tokens per second over all processes, after the first steps (warm-up, compilation)
    tokens_per_s: float
    parameters: int
    trainable_parameters: int
    packed: bool
    padding_fraction: float
    peak_memory_mb: float
    strategy: str
    world_size: int
    # the step this run resumed from (0: from the start)
    resumed_from_step: int
    flops_per_token: float
    tflops_per_device: float
    # None where the card's peak is unknown (and on CPU)
    mfu: float | None


TrainRecord = StageRecord[TrainFigures]


class Session(BaseModel):
    """What every training process needs to know besides the config: where, which run, from which checkpoint."""

    folder: str
    key: str
    run: RunHandle | None = None
    resume_from: str | None = None
    plan: dict[str, Any]


def train(config: PipelineConfig, tokenized: TokenizeRecord, run: RunHandle | None = None) -> TrainRecord:
    root = workspace.project_root()
    plan = launch.plan_launch(config.train)
    key = keys.stage_key("train", config, {"tokenize": tokenized.key}, inputs(config, root, plan))

    def build(folder: Path) -> TrainFigures:
        return run_training(config, tokenized, Session(folder=str(folder), key=key, run=run,
                                                      plan=plan.__dict__))

    return workspace.build_artifact(TrainRecord, "train", key, build, [tokenized], content=model_files,
                                    resumable=True)


def model_files(relative: str) -> bool:
    """The weights and tokenizer define a trained model: the same ones are never registered twice."""
    return relative.startswith("model/")


def inputs(config: PipelineConfig, root: Path, plan: LaunchPlan) -> dict[str, Any]:
    """A pretrained base's content, and how the training is spread: both shape the weights."""
    return {"base": modeling.base_fingerprint(config.model, root, config.tracking), "launch": launch.fingerprint(plan),
            "attention": modeling.attention_for(config.model)}


def input_fingerprints(config: PipelineConfig, root: Path) -> dict[str, Any]:
    return inputs(config, root, launch.plan_launch(config.train))


def run_training(config: PipelineConfig, tokenized: TokenizeRecord, session: Session) -> TrainFigures:
    """Train in this process or in launched workers, from the last complete checkpoint, then finish the folder."""
    folder, plan = Path(session.folder), LaunchPlan(**session.plan)
    resume = resume_point(config.train, folder, session.key)
    session = session.model_copy(update={"resume_from": str(resume) if resume else None})
    tracking.link_resumed_run(folder / "runs.json", session.run)
    (folder / INTERRUPTED_FILE).unlink(missing_ok=True)
    if plan.inline:
        figures = fit(config, tokenized, session)
    else:
        spec = folder / SPEC_FILE
        spec.write_text(json.dumps({"config": config.as_dict(), "tokenized": tokenized.model_dump(mode="json"),
                                    "session": session.model_dump(mode="json")}))
        launch.run_workers(plan, config.train, spec, folder)
        stopped = folder / INTERRUPTED_FILE
        if stopped.is_file():
            raise TrainingInterrupted(json.loads(stopped.read_text())["message"])
        figures = TrainFigures.model_validate_json((folder / FIGURES_FILE).read_text())
    finish(folder, config.train, session.key)
    return figures


def resume_point(config: TrainConfig, folder: Path, key: str) -> Path | None:
    """The newest complete checkpoint here, else in the checkpoint store; the ledger forgets the steps after it."""
    local = folder / "checkpoints"
    local.mkdir(parents=True, exist_ok=True)
    found = checkpoints.latest_complete(local)
    if found is None and config.checkpoint_dir:
        found = checkpoints.download_latest(config.checkpoint_dir, key, local)
    checkpoints_step = checkpoints.step_of(found) if found else 0
    (folder / "ledger").mkdir(exist_ok=True)
    from llmops.training.callbacks import trim_ledger

    trim_ledger(folder / "ledger", checkpoints_step)
    if found:
        log.info("resuming training from %s", found.name)
    return found


def finish(folder: Path, config: TrainConfig, key: str) -> None:
    """Consolidate sharded weights into one file and drop what only a resume needed."""
    kind = checkpoints.consolidate(folder / "model")
    if kind:
        log.info("consolidated the %s shards into model/model.safetensors", kind)
    for transient in ("checkpoints", "set-aside", SPEC_FILE, FIGURES_FILE, "runs.json"):
        target = folder / transient
        shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
    if config.checkpoint_dir:
        checkpoints.forget(config.checkpoint_dir, key)


def load_tokenizer(tokenized_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenized_dir / "tokenizer"))


def precision_flags(config: TrainConfig) -> dict[str, bool]:
    """bf16 where the GPU supports it, fp16 on older GPUs, fp32 on CPU."""
    import torch

    choice = config.precision
    if choice == "auto" and not torch.cuda.is_available():
        choice = "fp32"
    elif choice == "auto":
        choice = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return {"bf16": choice == "bf16", "fp16": choice == "fp16"}


def training_arguments(config: TrainConfig, kind: RecordKind, output_dir: Path, packed: bool,
                       plan: LaunchPlan) -> Any:
    from transformers import TrainingArguments
    from trl import SFTConfig

    evaluating = config.eval_steps is not None
    common: dict[str, Any] = {
        "output_dir": str(output_dir / "checkpoints"),
        "num_train_epochs": config.epochs,
        "max_steps": config.max_steps,
        "per_device_train_batch_size": config.batch_size,
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
        "train_sampling_strategy": "group_by_length" if config.group_by_length and not packed else "random",
        "length_column_name": "length",
        "report_to": [],
        "disable_tqdm": True,
        "include_num_input_tokens_seen": "non_padding",
        "dataloader_num_workers": 0,
        # the datasets hold exactly the columns the collator reads
        "remove_unused_columns": False,
        **precision_flags(config),
        **distributed_arguments(config, plan),
    }
    if kind == "seq2seq":
        return seq2seq.training_arguments(common)
    if kind in ("text", "classification", "tokens"):
        return TrainingArguments(**common)
    if kind == "preference":
        return dpo.arguments(common, config.preference_beta)
    return SFTConfig(**common, max_length=None, packing=False, dataset_kwargs={"skip_prepare_dataset": True})


def distributed_arguments(config: TrainConfig, plan: LaunchPlan) -> dict[str, Any]:
    """The Trainer's side of the launch: CPU processes join over gloo only with use_cpu (else each trains alone);
    DeepSpeed reads its JSON; FSDP comes from the accelerate launch environment."""
    arguments: dict[str, Any] = {"use_cpu": plan.device == "cpu", "torch_compile": config.compile,
                                 "optim": "adamw_torch_fused" if plan.device == "cuda" else "adamw_torch"}
    if plan.strategy == "deepspeed":
        arguments["deepspeed"] = plan.config_file
    if plan.strategy == "ddp":
        arguments["ddp_find_unused_parameters"] = False
    return arguments


def datasets_for(tokenized_dir: Path, packed: bool, max_length: int) -> tuple[Any, Any]:
    """Train rows packed into sequences of `max_length` tokens, or one sample per row; eval rows as they are.
    Every training row carries the ids of its samples, for the ledger."""
    train_set = workspace.load_dataset_dir(tokenized_dir / "train")
    eval_set = workspace.load_dataset_dir(tokenized_dir / "eval").select_columns(["input_ids", "labels"])
    if packed:
        return packing.pack(packing.with_sample_ids(train_set, per_token=True), max_length), eval_set
    columns = ["input_ids", "labels", "length", packing.SAMPLE_IDS]
    return packing.with_sample_ids(train_set, per_token=False).select_columns(columns), eval_set


def collator_for(kind: RecordKind, tokenizer: Any, model: Any, packed: bool, max_length: int) -> Any:
    from transformers import DataCollatorWithPadding
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    if kind == "classification":
        collate = DataCollatorWithPadding(tokenizer)
    elif kind == "tokens":
        collate = token_classification.collator(tokenizer)
    elif kind == "seq2seq":
        collate = seq2seq.collator(tokenizer, model)
    elif packed:
        collate = packing.packed_collator(model, tokenizer.pad_token_id, max_length)
    else:
        collate = DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id)
    return packing.BatchMeter(collate)


def decide_packing(config: TrainConfig, kind: RecordKind, model: Any, tokenized_dir: Path, pad_token_id: int) -> bool:
    """Pack when configured and the model gives packed samples the same logits as separate ones."""
    # a row per sample: classifiers, taggers and preference pairs read each row's tokens as sequences of their own
    if not config.packing or kind in ("classification", "tokens", "preference"):
        return False
    if kind == "seq2seq":  # the source and the target are separate sequences: there is nothing to pack
        return False
    train_set = workspace.load_dataset_dir(tokenized_dir / "train")
    samples = [row["input_ids"][:16] for row in train_set.select(range(min(3, len(train_set))))]
    if packing.packing_is_exact(model, samples, pad_token_id):
        return True
    log.warning("packing is off: %s does not keep packed samples apart (attention %s)", type(model).__name__,
                getattr(model.config, "_attn_implementation", "?"))
    return False


def fit(pipeline: PipelineConfig, tokenized: TokenizeRecord, session: Session) -> TrainFigures:
    """One training process: build the model and Trainer, train from the resume point, save; figures on rank 0."""
    from llmops.training.callbacks import StopOnSignal

    trainer, meter, packed = build_trainer(pipeline, tokenized, session)
    stop = next(c for c in trainer.callback_handler.callbacks if isinstance(c, StopOnSignal))
    started = time.perf_counter()
    initial_step = checkpoints.step_of(session.resume_from) if session.resume_from else 0
    # a worker leaves SIGTERM to its launcher (which uses it to tear the group down); alone, both signals stop
    signals = (2,) if LaunchPlan(**session.plan).world_size > 1 else (2, 15)
    with stop.listening(signals), tracking.system_metrics(session.run, trainer.is_world_process_zero()), \
            training_errors(pipeline.train):
        trainer.train(resume_from_checkpoint=session.resume_from)
    seconds = time.perf_counter() - started
    folder = Path(session.folder)
    if stop.requested.is_set():
        message = (f"training stopped at step {trainer.state.global_step} and saved a checkpoint there; run the "
                   "same command again to resume")
        if trainer.is_world_process_zero():
            (folder / INTERRUPTED_FILE).write_text(json.dumps({"message": message}))
        raise TrainingInterrupted(message)
    save(trainer, load_tokenizer(tokenized.dir), pipeline, folder / "model")
    figures = summarize(trainer, meter, packed, seconds, session, tokenized, initial_step)
    if trainer.is_world_process_zero():
        (folder / FIGURES_FILE).write_text(figures.model_dump_json())
    return figures


def build_trainer(pipeline: PipelineConfig, tokenized: TokenizeRecord, session: Session) -> tuple[Any, Any, bool]:
    from transformers import EarlyStoppingCallback, PrinterCallback, Trainer
    from trl import SFTTrainer

    from llmops.training.callbacks import (
        CheckpointCallback,
        LedgerCallback,
        MetricsCallback,
        StopOnSignal,
        ThroughputCallback,
    )

    config, data = pipeline.train, pipeline.data
    model_config = registered_base.resolved_model(pipeline.model, pipeline.tracking)
    kind, tokenized_dir, plan = data.kind, tokenized.dir, LaunchPlan(**session.plan)
    tokenizer = load_tokenizer(tokenized_dir)
    model = modeling.build_model(model_config, tokenizer, config.seed, kind, data.labels,
                                 quantize=model_config.adapter == "qlora", objective=data.objective)
    model.config.use_cache = False  # training never decodes; packed masks need it off
    # an encoder attends both ways: packed samples would see each other, so masked LM is never packed
    masked = data.objective == "masked_lm"
    packed = not masked and decide_packing(config, kind, model, tokenized_dir, tokenizer.pad_token_id)
    if kind != "preference":  # DPO adds its adapter itself, so that its reference is the adapter switched off
        model = modeling.with_adapter(model, model_config, kind, config.gradient_checkpointing)
    max_length = tokenized.figures.max_length
    train_set, eval_set = dpo.datasets_for(tokenized_dir) if kind == "preference" else \
        datasets_for(tokenized_dir, packed, max_length)
    if kind == "preference":
        meter = dpo.meter(tokenizer.pad_token_id)
    elif masked:
        meter = packing.BatchMeter(masked_lm.MaskingCollator(tokenizer, config.seed))
    else:
        meter = collator_for(kind, tokenizer, model, packed, max_length)
    folder = Path(session.folder)
    arguments = training_arguments(config, kind, folder, packed, plan)
    ledger = folder / "ledger" / f"rank-{arguments.process_index}.jsonl"
    callbacks = [MetricsCallback(session.run, prefix="train", padding=meter), LedgerCallback(meter, ledger),
                 CheckpointCallback(config.checkpoint_dir, session.key), StopOnSignal(),
                 ThroughputCallback(skip_steps=warmup_steps(config))]
    if config.early_stopping_patience is not None:
        callbacks.append(EarlyStoppingCallback(early_stopping_patience=config.early_stopping_patience))
    settings = {"args": arguments, "train_dataset": train_set, "eval_dataset": eval_set if config.eval_steps else None,
                "processing_class": tokenizer, "data_collator": meter, "callbacks": callbacks}
    if kind == "preference":
        trainer = dpo.trainer(model, *dpo_reference(model_config, tokenizer, config.seed, kind), **settings)
    elif kind == "seq2seq":
        trainer_class, extra = seq2seq.trainer_settings(tokenizer)
        trainer = trainer_class(model=model, **settings, **extra)
    else:
        trainer_class = SFTTrainer if kind in ("instruction", "chat") else Trainer
        trainer = trainer_class(model=model, **settings)
    # progress goes to the run's log and MLflow through MetricsCallback, not to stdout
    trainer.remove_callback(PrinterCallback)
    return trainer, meter, packed


def dpo_reference(model_config: ModelConfig, tokenizer: Any, seed: int, kind: RecordKind) -> tuple[Any, Any]:
    """DPO's reference: with an adapter, the starting model itself with the adapter off (the LoRA settings go to
    the trainer); for full fine-tuning, a frozen second copy of the starting model."""
    if model_config.adapter != "none":
        return None, modeling.lora_settings(model_config.lora, kind)
    return modeling.build_model(model_config, tokenizer, seed, kind).eval().requires_grad_(False), None


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
    if model_config.adapter != "none" and model_config.lora.merge:
        if trainer.is_world_process_zero():
            model.save_pretrained(str(target.parent / "adapter"))
            model.merge_and_unload().save_pretrained(str(target))
    else:
        trainer.save_model(str(target))  # every process takes part: sharded weights are gathered
    if not trainer.is_world_process_zero():
        return
    tokenizer.save_pretrained(str(target))
    (target / "training_args.bin").unlink(missing_ok=True)  # a pickle: the folder holds safetensors only
    (target / "training_args.json").write_text(json.dumps(portable_arguments(trainer.args), indent=2,
                                                          sort_keys=True))
    if modeling.has_label_set(pipeline.data.kind):
        modeling.save_labels(target, pipeline.data.labels)
    state = json.loads(json.dumps(dataclasses.asdict(trainer.state), default=str))
    if state.get("best_model_checkpoint"):
        state["best_model_checkpoint"] = Path(state["best_model_checkpoint"]).name
    (target.parent / "trainer_state.json").write_text(json.dumps(state, indent=2, sort_keys=True))


def portable_arguments(arguments: Any) -> dict[str, Any]:
    """The Trainer's arguments without the fields that hold this machine's paths."""
    values = json.loads(arguments.to_json_string())
    for field in ("output_dir", "logging_dir", "deepspeed", "hub_token", "push_to_hub_token"):
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


def summarize(trainer: Any, meter: Any, packed: bool, seconds: float, session: Session, tokenized: TokenizeRecord,
              initial_step: int) -> TrainFigures:
    from llmops.training.callbacks import ThroughputCallback, peak_memory_mb

    plan = LaunchPlan(**session.plan)
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    evaluations = [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry]
    tokens = int(trainer.state.num_input_tokens_seen)  # restored from the checkpoint: the whole training's
    this_run = tokens - int(getattr(trainer, "_initial_num_input_tokens_seen", 0))
    clock = next(c for c in trainer.callback_handler.callbacks if isinstance(c, ThroughputCallback))
    steady_tokens, steady_seconds = clock.rate() or (this_run, seconds)
    per_token = throughput.flops_per_token(trainer.model, tokenized.figures.max_length)
    rates = throughput.throughput(steady_tokens, steady_seconds, per_token, plan.world_size)
    return TrainFigures(
        steps=int(trainer.state.global_step), epochs=float(trainer.state.epoch or 0),
        train_loss=training_loss(history), first_logged_loss=float(history[0]["loss"]) if history else None,
        last_logged_loss=float(history[-1]["loss"]) if history else None,
        best_eval_loss=min(evaluations) if evaluations else None, tokens=tokens, seconds=round(seconds, 2),
        tokens_per_s=rates["tokens_per_s"], **modeling.parameter_counts(trainer.model), packed=packed,
        padding_fraction=round(meter.padding_fraction(), 4), peak_memory_mb=peak_memory_mb(), strategy=plan.strategy,
        world_size=plan.world_size, resumed_from_step=initial_step,
        flops_per_token=per_token,
        tflops_per_device=rates["tflops_per_device"], mfu=rates["mfu"])


def worker_main(spec_path: str) -> int:
    """A launched training process: read the spec, train, and on failure leave the error where the launcher
    reads it (the traceback goes to this process's output, which the launcher keeps in its log)."""
    from accelerate import PartialState

    spec = json.loads(Path(spec_path).read_text())
    config = PipelineConfig.model_validate(spec["config"])
    tokenized = TokenizeRecord.model_validate(spec["tokenized"])
    session = Session.model_validate(spec["session"])
    rank = int(os.environ.get("RANK", "0"))
    show_progress(rank)
    try:
        fit(config, tokenized, session)
    except TrainingInterrupted:
        return 0
    except BaseException as err:
        report_failure(Path(session.folder) / "logs", rank, err)
        return 1
    finally:
        if PartialState().use_distributed:
            import torch

            torch.distributed.destroy_process_group()
    return 0


def show_progress(rank: int) -> None:
    """A worker's log lines go to its output, marked so that the launcher passes them on to the stage log."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"{launch.PROGRESS_MARK}[rank {rank}] %(message)s"))
    logger = logging.getLogger("llmops")
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)


def report_failure(logs: Path, rank: int, err: BaseException) -> None:
    traceback.print_exc()
    logs.mkdir(parents=True, exist_ok=True)
    message = str(err) if isinstance(err, modeling.HardwareError) else f"{type(err).__name__}: {err}"
    (logs / f"error-rank-{rank}.json").write_text(json.dumps({"rank": rank, "time": time.time(),
                                                              "message": " ".join(message.split())[:1000]}))


if __name__ == "__main__":
    from llmops.training import train as module

    sys.exit(module.worker_main(sys.argv[1]))
