"""Evaluate: the trained model and its starting point, on the same held-out examples.

Language models: perplexity over the held-out split's target tokens (responses for instruction
and chat data, all tokens for plain text), and for instruction and chat data exact match of
greedy generations of the last assistant turn. Classifiers: accuracy and macro-F1. The starting
point is the untrained model (same random init as training) or the base pretrained model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tasks import keys, modeling, workspace
from tasks.config import EvaluateConfig, ModelConfig, PipelineConfig, RecordKind
from tasks.dedup import DedupRecord
from tasks.templates import prompt_and_reference, render
from tasks.tokenize import IGNORE_INDEX, TokenizeRecord
from tasks.train import TrainRecord
from tasks.workspace import Figures, StageRecord

# the metric that decides champion vs challenger, and whether higher is better
PRIMARY_METRIC = {"instruction": ("exact_match", True), "chat": ("exact_match", True),
                  "text": ("perplexity", False), "classification": ("macro_f1", True)}


class EvaluateFigures(Figures):
    # model ("trained", and "untrained" or "base") -> metric name -> value; names are the code's own
    metrics: dict[str, dict[str, float]]
    primary_metric: str
    higher_is_better: bool
    examples: int
    eval_rows: int

    NAMED_MAPS = ("metrics",)


EvaluateRecord = StageRecord[EvaluateFigures]


def evaluate(config: PipelineConfig, trained: TrainRecord, tokenized: TokenizeRecord,
             deduped: DedupRecord) -> EvaluateRecord:
    upstream = [trained, tokenized, deduped]
    key = keys.key_for("evaluate", config, upstream, workspace.project_root())

    def build(folder: Path) -> EvaluateFigures:
        return compare(config, trained.dir / "model", tokenized.dir, deduped.dir / "eval.jsonl", folder)

    return workspace.build_artifact(EvaluateRecord, "evaluate", key, build, upstream)


def baseline_name(model_config: ModelConfig) -> str:
    return "base" if model_config.name_or_path else "untrained"


def compare(pipeline: PipelineConfig, model_dir: Path, tokenized_dir: Path, eval_rows: Path,
            folder: Path) -> EvaluateFigures:
    """The trained model and its starting point, scored on the same held-out rows."""
    from transformers import AutoTokenizer

    config, model_config, data, seed = pipeline.evaluate, pipeline.model, pipeline.data, pipeline.train.seed
    kind = data.kind
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    dataset = workspace.load_dataset_dir(tokenized_dir / "eval")
    rows = list(workspace.read_jsonl(eval_rows))
    models = {"trained": modeling.load_trained(model_dir, kind),
              baseline_name(model_config): modeling.build_model(model_config, tokenizer, seed, kind, data.labels)}
    metrics: dict[str, dict[str, float]] = {}
    outputs: dict[str, list[Any]] = {}
    for name, model in models.items():
        model = modeling.place(model).eval()
        metrics[name], outputs[name] = score(model, tokenizer, dataset, rows, kind, data.labels, config)
    workspace.write_jsonl(folder / "samples.jsonl", samples(rows, outputs, kind, config.max_examples))
    (folder / "metrics.json").write_text(json.dumps(metrics, indent=2))
    primary, higher_is_better = PRIMARY_METRIC[kind]
    return EvaluateFigures(metrics=metrics, primary_metric=primary, higher_is_better=higher_is_better,
                           examples=min(len(rows), config.max_examples), eval_rows=len(dataset))


def score(model: Any, tokenizer: Any, dataset: Any, rows: list[dict[str, Any]], kind: RecordKind,
          labels: list[str], config: EvaluateConfig) -> tuple[dict[str, float], list[Any]]:
    if kind == "classification":
        predicted = classify(model, tokenizer, dataset, config.batch_size)
        return classification_metrics(predicted, dataset["labels"]), [labels[i] for i in predicted]
    metrics = {"perplexity": perplexity(model, dataset, tokenizer.pad_token_id, config.batch_size)}
    if kind == "text":
        return metrics, []
    generated = generate(model, tokenizer, rows[: config.max_examples], kind, config)
    references = [prompt_and_reference(row, kind)[1] for row in rows[: config.max_examples]]
    return {**metrics, "exact_match": exact_match(generated, references)}, generated


def samples(rows: list[dict[str, Any]], outputs: dict[str, list[Any]], kind: RecordKind,
            limit: int) -> list[dict[str, Any]]:
    """Held-out rows next to what each model made of them, for a person to read."""
    if kind == "text":
        return []
    table = []
    for index, row in enumerate(rows[:limit]):
        if kind == "classification":
            entry = {"text": row["text"], "reference": str(row["label"])}
        else:
            prompt, reference = prompt_and_reference(row, kind)
            entry = {"prompt": prompt[-1]["content"], "reference": reference}
        table.append({**entry, **{f"{name}_output": values[index] for name, values in outputs.items()}})
    return table


def classify(model: Any, tokenizer: Any, dataset: Any, batch_size: int) -> list[int]:
    import torch
    from transformers import DataCollatorWithPadding

    collate = DataCollatorWithPadding(tokenizer)
    predicted: list[int] = []
    with torch.no_grad():
        for start in range(0, len(dataset), batch_size):
            rows = dataset.select(range(start, min(start + batch_size, len(dataset))))
            batch = modeling.on_device(collate([{"input_ids": ids} for ids in rows["input_ids"]]), model)
            predicted.extend(model(**batch).logits.argmax(-1).tolist())
    return predicted


def classification_metrics(predicted: list[int], truth: list[int]) -> dict[str, float]:
    from sklearn.metrics import accuracy_score, f1_score

    return {"accuracy": float(accuracy_score(truth, predicted)),
            "macro_f1": float(f1_score(truth, predicted, average="macro", zero_division=0))}


def perplexity(model: Any, dataset: Any, pad_token_id: int, batch_size: int) -> float:
    """exp of the mean negative log-likelihood per target token."""
    import torch
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    collate = DataCollatorForLanguageModeling(pad_token_id=pad_token_id)
    total_loss, total_tokens = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(dataset), batch_size):
            batch = modeling.on_device(
                collate([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]), model)
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            targets = batch["labels"][:, 1:]
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(),
                                                     targets.reshape(-1), ignore_index=IGNORE_INDEX,
                                                     reduction="sum")
            total_loss += loss.item()
            total_tokens += int((targets != IGNORE_INDEX).sum())
    return math.exp(total_loss / total_tokens) if total_tokens else math.nan


def generate(model: Any, tokenizer: Any, rows: list[dict[str, Any]], kind: RecordKind,
             config: EvaluateConfig) -> list[str]:
    """Greedy completions of each row's last assistant turn, batched with left padding."""
    import torch

    tokenizer.padding_side = "left"
    outputs: list[str] = []
    for start in range(0, len(rows), config.batch_size):
        prompts = [render(tokenizer, prompt_and_reference(row, kind)[0], generation_prompt=True)
                   for row in rows[start:start + config.batch_size]]
        batch = modeling.on_device(tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False),
                                   model)
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
