"""Train: HF Trainer (causal LM, classification) or TRL's SFTTrainer (instruction, chat) on the tokenized cache.

The model is built from the config with random init, or loaded with `from_pretrained`; full
fine-tuning or a LoRA / QLoRA adapter. Samples are packed padding-free where the model passes
the packing check. Work happens in a resumable folder: a run that dies resumes from its last
checkpoint; the folder is renamed into place only once the final weights are saved.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

from tasks import keys, modeling, packing, workspace
from tasks.config import ModelConfig, PipelineConfig, RecordKind, TrainConfig
from tasks.tokenize import TokenizeRecord
from tasks.tracking import RunHandle
from tasks.workspace import Figures, StageRecord

log = logging.getLogger("llmops.train")


class TrainFigures(Figures):
    steps: int
    epochs: float
    train_loss: float
    first_logged_loss: float | None
    last_logged_loss: float | None
    best_eval_loss: float | None
    tokens: int
    seconds: float
    tokens_per_s: float
    parameters: int
    trainable_parameters: int
    packed: bool
    padding_fraction: float
    peak_memory_mb: float


TrainRecord = StageRecord[TrainFigures]


def train(config: PipelineConfig, tokenized: TokenizeRecord, run: RunHandle | None = None) -> TrainRecord:
    key = keys.key_for("train", config, [tokenized], workspace.project_root())

    def build(folder: Path) -> TrainFigures:
        return fit(config, tokenized, folder, run)

    return workspace.build_artifact(TrainRecord, "train", key, build, [tokenized], content=model_files,
                                    resumable=True)


def model_files(relative: str) -> bool:
    """The weights and tokenizer define a trained model: the same ones are never registered twice."""
    return relative.startswith("model/")


def input_fingerprints(config: PipelineConfig, root: Path) -> dict[str, Any]:
    """A pretrained base: its files' content when it is a local folder, else its hub id and revision."""
    return {"base": modeling.base_fingerprint(config.model, root)}


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


def training_arguments(config: TrainConfig, kind: RecordKind, output_dir: Path, packed: bool) -> Any:
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
    }
    if kind in ("text", "classification"):
        return TrainingArguments(**common)
    return SFTConfig(**common, max_length=None, packing=False, dataset_kwargs={"skip_prepare_dataset": True})


def datasets_for(tokenized_dir: Path, packed: bool, max_length: int) -> tuple[Any, Any]:
    """Train rows packed into sequences of `max_length` tokens, or one sample per row; eval rows as they are."""
    train_set = workspace.load_dataset_dir(tokenized_dir / "train")
    eval_set = workspace.load_dataset_dir(tokenized_dir / "eval").select_columns(["input_ids", "labels"])
    if packed:
        return packing.pack(train_set, max_length), eval_set
    return train_set.select_columns(["input_ids", "labels", "length"]), eval_set


def collator_for(kind: RecordKind, tokenizer: Any, model: Any, packed: bool) -> Any:
    from transformers import DataCollatorWithPadding
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    if kind == "classification":
        collate = DataCollatorWithPadding(tokenizer)
    elif packed:
        collate = packing.packed_collator(model, tokenizer.pad_token_id)
    else:
        collate = DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id)
    return packing.PaddingMeter(collate)


def decide_packing(config: TrainConfig, kind: RecordKind, model: Any, tokenized_dir: Path, pad_token_id: int) -> bool:
    """Pack when configured and the model gives packed samples the same logits as separate ones."""
    if not config.packing or kind == "classification":
        return False
    train_set = workspace.load_dataset_dir(tokenized_dir / "train")
    samples = [row["input_ids"][:16] for row in train_set.select(range(min(3, len(train_set))))]
    if packing.packing_is_exact(model, samples, pad_token_id):
        return True
    log.warning("packing is off: %s does not keep packed samples apart (attention %s)", type(model).__name__,
                getattr(model.config, "_attn_implementation", "?"))
    return False


def fit(pipeline: PipelineConfig, tokenized: TokenizeRecord, folder: Path, run: RunHandle | None) -> TrainFigures:
    from transformers import EarlyStoppingCallback, PrinterCallback, Trainer
    from trl import SFTTrainer

    from tasks.callbacks import MetricsCallback, peak_memory_mb

    config, model_config, data = pipeline.train, pipeline.model, pipeline.data
    kind, tokenized_dir = data.kind, tokenized.dir
    tokenizer = load_tokenizer(tokenized_dir)
    model = modeling.build_model(model_config, tokenizer, config.seed, kind, data.labels,
                                 quantize=model_config.adapter == "qlora")
    model.config.use_cache = False  # training never decodes; packed masks need it off
    packed = decide_packing(config, kind, model, tokenized_dir, tokenizer.pad_token_id)
    model = modeling.with_adapter(model, model_config, kind, config.gradient_checkpointing)
    train_set, eval_set = datasets_for(tokenized_dir, packed, tokenized.figures.max_length)
    collator = collator_for(kind, tokenizer, model, packed)
    callbacks = [MetricsCallback(run, prefix="train", padding=collator)]
    if config.early_stopping_patience is not None:
        callbacks.append(EarlyStoppingCallback(early_stopping_patience=config.early_stopping_patience))
    trainer_class = SFTTrainer if kind in ("instruction", "chat") else Trainer
    trainer = trainer_class(model=model, args=training_arguments(config, kind, folder, packed), train_dataset=train_set,
                            eval_dataset=eval_set if config.eval_steps else None, processing_class=tokenizer,
                            data_collator=collator, callbacks=callbacks)
    # progress goes to the run's log and MLflow through MetricsCallback, not to stdout
    trainer.remove_callback(PrinterCallback)
    checkpoint = last_checkpoint(folder / "checkpoints")
    if checkpoint:
        log.info("resuming training from %s", checkpoint)
    started = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    seconds = time.perf_counter() - started
    save(trainer, tokenizer, model_config, folder / "model")
    if modeling.is_classifier(kind):
        modeling.save_labels(folder / "model", data.labels)
    trainer.state.save_to_json(str(folder / "trainer_state.json"))
    shutil.rmtree(folder / "checkpoints", ignore_errors=True)
    return TrainFigures(**summarize(trainer, result, seconds), **modeling.parameter_counts(model), packed=packed,
                        padding_fraction=round(collator.padding_fraction(), 4), peak_memory_mb=peak_memory_mb())


def save(trainer: Any, tokenizer: Any, model_config: ModelConfig, target: Path) -> None:
    """The weights (or the adapter, or the base with the adapter merged in) and the tokenizer."""
    model = trainer.model
    if model_config.adapter != "none" and model_config.lora.merge:
        model.save_pretrained(str(target.parent / "adapter"))
        model = model.merge_and_unload()
        model.save_pretrained(str(target))
    else:
        trainer.save_model(str(target))
        (target / "training_args.bin").unlink(missing_ok=True)  # a pickle: the folder holds safetensors only
    tokenizer.save_pretrained(str(target))


def last_checkpoint(folder: Path) -> Path | None:
    from transformers.trainer_utils import get_last_checkpoint

    return Path(found) if folder.is_dir() and (found := get_last_checkpoint(str(folder))) else None


def summarize(trainer: Any, result: Any, seconds: float) -> dict[str, Any]:
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    evaluations = [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry]
    tokens = int(trainer.state.num_input_tokens_seen)
    return {
        "steps": int(trainer.state.global_step),
        "epochs": float(trainer.state.epoch or 0),
        "train_loss": float(result.training_loss),
        "first_logged_loss": float(history[0]["loss"]) if history else None,
        "last_logged_loss": float(history[-1]["loss"]) if history else None,
        "best_eval_loss": min(evaluations) if evaluations else None,
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1) if seconds else 0.0,
    }
