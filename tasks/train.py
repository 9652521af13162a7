"""Train: HF Trainer (causal LM) or TRL's SFTTrainer (instruction data) on the tokenized cache.

The model is built from the config with random init, or loaded with `from_pretrained`. Work
happens in a resumable folder: a run that dies resumes from its last checkpoint; the folder is
renamed into place only once the final weights are saved.
"""

from __future__ import annotations

import logging
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from flows.config import ModelConfig, PipelineConfig, RecordKind, TrainConfig
from tasks import tracking, workspace
from tasks.tracking import RunHandle
from tasks.workspace import StageRecord

log = logging.getLogger("llmops.train")


def train(config: TrainConfig, model_config: ModelConfig, kind: RecordKind, tokenized: StageRecord,
          run: RunHandle | None = None) -> StageRecord:
    key = workspace.stage_key(
        "train", {"train": config.model_dump(), "model": model_config.model_dump()}, [tokenized],
        workspace.code_version(sys.modules[__name__]), kind=kind,
    )

    def build(folder: Path) -> tuple[str, dict[str, Any]]:
        stats = fit(config, model_config, kind, tokenized.dir, folder, run)
        return workspace.hash_tree(folder / "model"), stats

    return workspace.build_artifact("train", key, build, resumable=True)


def load_tokenizer(tokenized_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenized_dir / "tokenizer"))


def build_model(model_config: ModelConfig, tokenizer: Any, seed: int) -> Any:
    """A pretrained model, or a fresh one whose random init is fixed by `seed`."""
    import transformers

    transformers.set_seed(seed)
    if model_config.name_or_path:
        return transformers.AutoModelForCausalLM.from_pretrained(
            model_config.name_or_path, trust_remote_code=model_config.trust_remote_code)
    return transformers.AutoModelForCausalLM.from_config(scratch_config(model_config, tokenizer))


def scratch_config(model_config: ModelConfig, tokenizer: Any) -> Any:
    from transformers import GPT2Config, LlamaConfig

    hidden, layers, heads = model_config.hidden_size, model_config.num_layers, model_config.num_heads
    inner = model_config.intermediate_size or 4 * hidden
    ids = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
           "eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id}
    if model_config.architecture == "gpt2":
        return GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_inner=inner, n_positions=2048, **ids)
    return LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=heads, intermediate_size=inner, max_position_embeddings=2048,
                       tie_word_embeddings=True, **ids)


def precision_flags(config: TrainConfig) -> dict[str, bool]:
    """bf16 where the GPU supports it, fp16 on older GPUs, fp32 on CPU."""
    import torch

    choice = config.precision
    if choice == "auto" and not torch.cuda.is_available():
        choice = "fp32"
    elif choice == "auto":
        choice = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return {"bf16": choice == "bf16", "fp16": choice == "fp16"}


def training_arguments(config: TrainConfig, kind: RecordKind, output_dir: Path) -> Any:
    from transformers import TrainingArguments
    from trl import SFTConfig

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
        "save_steps": config.save_steps,
        "save_total_limit": config.save_total_limit,
        "report_to": [],
        "disable_tqdm": True,
        "include_num_input_tokens_seen": "non_padding",
        "dataloader_num_workers": 0,
        **precision_flags(config),
    }
    if kind == "text":
        return TrainingArguments(**common)
    return SFTConfig(**common, max_length=None, packing=False,
                     dataset_kwargs={"skip_prepare_dataset": True})


def fit(config: TrainConfig, model_config: ModelConfig, kind: RecordKind, tokenized_dir: Path, folder: Path,
        run: RunHandle | None) -> dict[str, Any]:
    from datasets import load_from_disk
    from transformers import PrinterCallback, Trainer
    from trl import SFTTrainer
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from tasks.callbacks import MetricsCallback

    tokenizer = load_tokenizer(tokenized_dir)
    model = build_model(model_config, tokenizer, config.seed)
    dataset = load_from_disk(str(tokenized_dir / "train"))
    args = training_arguments(config, kind, folder)
    collator = DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id)
    trainer_class = Trainer if kind == "text" else SFTTrainer
    trainer = trainer_class(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                            data_collator=collator, callbacks=[MetricsCallback(run, prefix="train")])
    # progress goes to the run's log and MLflow through MetricsCallback, not to stdout
    trainer.remove_callback(PrinterCallback)
    checkpoint = last_checkpoint(folder / "checkpoints")
    if checkpoint:
        log.info("resuming training from %s", checkpoint)
    started = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    seconds = time.perf_counter() - started
    trainer.save_model(str(folder / "model"))
    tokenizer.save_pretrained(str(folder / "model"))
    trainer.state.save_to_json(str(folder / "trainer_state.json"))
    shutil.rmtree(folder / "checkpoints", ignore_errors=True)
    return summarize(trainer, result, seconds, model)


def last_checkpoint(folder: Path) -> Path | None:
    from transformers.trainer_utils import get_last_checkpoint

    return Path(found) if folder.is_dir() and (found := get_last_checkpoint(str(folder))) else None


def summarize(trainer: Any, result: Any, seconds: float, model: Any) -> dict[str, Any]:
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    tokens = int(trainer.state.num_input_tokens_seen)
    return {
        "steps": int(trainer.state.global_step),
        "epochs": float(trainer.state.epoch or 0),
        "train_loss": float(result.training_loss),
        "first_logged_loss": float(history[0]["loss"]) if history else math.nan,
        "last_logged_loss": float(history[-1]["loss"]) if history else math.nan,
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1) if seconds else 0.0,
        "parameters": int(sum(p.numel() for p in model.parameters())),
        "trainable_parameters": int(sum(p.numel() for p in model.parameters() if p.requires_grad)),
    }


@task(name="train", cache_policy=NO_CACHE)
def train_task(config: PipelineConfig, tokenized: StageRecord, run: RunHandle) -> StageRecord:
    return tracking.tracked(run, lambda: train(config.train, config.model, config.data.kind, tokenized, run))
