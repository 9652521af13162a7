"""Evaluate: the trained model and its starting point, on the same held-out examples.

Perplexity over the held-out split's target tokens (responses for instruction data, all tokens
for plain text); for instruction data also exact match of greedy generations. The starting
point is the untrained model (same random init as training) or the base pretrained model.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from flows.config import EvaluateConfig, ModelConfig, PipelineConfig, RecordKind
from tasks import tracking, workspace
from tasks.tokenize import IGNORE_INDEX, prompt_messages
from tasks.tracking import RunHandle
from tasks.train import build_model
from tasks.workspace import StageRecord

# the metric that decides champion vs challenger, and whether higher is better
PRIMARY_METRIC = {"instruction": ("exact_match", True), "text": ("perplexity", False)}


def evaluate(config: EvaluateConfig, model_config: ModelConfig, seed: int, kind: RecordKind,
             trained: StageRecord, tokenized: StageRecord, deduped: StageRecord) -> StageRecord:
    key = workspace.stage_key(
        "evaluate", {"evaluate": config.model_dump(), "model": model_config.model_dump(), "seed": seed},
        [trained, tokenized, deduped], workspace.code_version(sys.modules[__name__]), kind=kind,
    )

    def build(folder: Path) -> tuple[str, dict[str, Any]]:
        stats = compare(config, model_config, seed, kind, trained.dir / "model", tokenized.dir,
                        deduped.dir / "eval.jsonl", folder)
        return workspace.hash_file(folder / "metrics.json"), stats

    return workspace.build_artifact("evaluate", key, build)


def baseline_name(model_config: ModelConfig) -> str:
    return "base" if model_config.name_or_path else "untrained"


def compare(config: EvaluateConfig, model_config: ModelConfig, seed: int, kind: RecordKind, model_dir: Path,
            tokenized_dir: Path, eval_rows: Path, folder: Path) -> dict[str, Any]:
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    dataset = load_from_disk(str(tokenized_dir / "eval"))
    rows = list(workspace.read_jsonl(eval_rows))[: config.max_examples]
    models = {
        "trained": AutoModelForCausalLM.from_pretrained(str(model_dir)),
        baseline_name(model_config): build_model(model_config, tokenizer, seed),
    }
    metrics: dict[str, dict[str, float]] = {}
    samples: dict[str, list[str]] = {}
    for name, model in models.items():
        model.eval()
        metrics[name] = {"perplexity": perplexity(model, dataset, tokenizer.pad_token_id, config.batch_size)}
        if kind == "instruction":
            samples[name] = generate(model, tokenizer, rows, config)
            metrics[name]["exact_match"] = exact_match(samples[name], [row["output"] for row in rows])
    if samples:
        workspace.write_jsonl(folder / "samples.jsonl", (
            {"prompt": prompt_messages(row)[0]["content"], "reference": row["output"],
             **{f"{name}_output": outputs[i] for name, outputs in samples.items()}}
            for i, row in enumerate(rows)))
    (folder / "metrics.json").write_text(json.dumps(metrics, indent=2))
    primary, higher_is_better = PRIMARY_METRIC[kind]
    return {"metrics": metrics, "primary_metric": primary, "higher_is_better": higher_is_better,
            "examples": len(rows), "eval_rows": len(dataset)}


def perplexity(model: Any, dataset: Any, pad_token_id: int, batch_size: int) -> float:
    """exp of the mean negative log-likelihood per target token."""
    import torch
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    collate = DataCollatorForLanguageModeling(pad_token_id=pad_token_id)
    total_loss, total_tokens = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(dataset), batch_size):
            batch = collate([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            targets = batch["labels"][:, 1:]
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(),
                                                     targets.reshape(-1), ignore_index=IGNORE_INDEX,
                                                     reduction="sum")
            total_loss += loss.item()
            total_tokens += int((targets != IGNORE_INDEX).sum())
    return math.exp(total_loss / total_tokens) if total_tokens else math.nan


def generate(model: Any, tokenizer: Any, rows: list[dict[str, Any]], config: EvaluateConfig) -> list[str]:
    """Greedy completions of each row's prompt, batched with left padding."""
    import torch

    tokenizer.padding_side = "left"
    outputs: list[str] = []
    for start in range(0, len(rows), config.batch_size):
        prompts = [tokenizer.apply_chat_template(prompt_messages(row), tokenize=False, add_generation_prompt=True)
                   for row in rows[start:start + config.batch_size]]
        batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            generated = model.generate(**batch, max_new_tokens=config.max_new_tokens, do_sample=False,
                                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        new_tokens = generated[:, batch["input_ids"].shape[1]:]
        outputs.extend(text.strip() for text in tokenizer.batch_decode(new_tokens, skip_special_tokens=True))
    return outputs


def exact_match(predictions: list[str], references: list[str]) -> float:
    if not references:
        return math.nan
    return sum(p.strip() == r.strip() for p, r in zip(predictions, references, strict=True)) / len(references)


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate_task(config: PipelineConfig, trained: StageRecord, tokenized: StageRecord, deduped: StageRecord,
                  run: RunHandle) -> StageRecord:
    record = tracking.tracked(run, lambda: evaluate(config.evaluate, config.model, config.train.seed,
                                                    config.data.kind, trained, tokenized, deduped))
    for name in ("metrics.json", "samples.jsonl"):
        tracking.log_file(run, record.dir / name, "evaluation")
    return record
