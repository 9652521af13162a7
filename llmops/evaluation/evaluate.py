"""Evaluate: the trained model and its starting point, on the same held-out examples, with 95% intervals.

The held-out examples are the first `evaluate.max_examples` rows of the eval split (written to
`heldout.jsonl`: the set a registered model name pins as its frozen evaluation set). Instruction
and chat models: the loss and perplexity of the response tokens alone, and on greedy generations
of the last assistant turn exact match, ROUGE-L, chrF, the mean generated length and the share of
generations cut at `max_new_tokens`. Plain text: loss and perplexity over every token; masked LM:
accuracy, loss and perplexity of the tokens a fixed per-row mask hides (llmops/objectives/masked_lm.py).
Classifiers: accuracy and macro-F1. Taggers (kind tokens): entity precision, recall and F1 (exact
span and type) and the share of words tagged right. The starting point is the untrained model (same random init as
training) or the base pretrained model. Each metric gets a bootstrap interval over the examples,
and the trained model's gain over its starting point a paired one. The scoring functions take
rows and a model, so the register stage scores a registered champion the same way.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llmops.core import keys, metrics, workspace
from llmops.core.config import DataConfig, EvaluateConfig, ModelConfig, PipelineConfig, RecordKind
from llmops.core.workspace import Figures, StageRecord
from llmops.data.dedup import DedupRecord
from llmops.data.tokenize import IGNORE_INDEX, Encoder, TokenizeRecord
from llmops.models import modeling
from llmops.objectives import dpo, masked_lm, preference, seq2seq, token_classification
from llmops.registry import registered_base
from llmops.text.templates import prompt_and_reference, render
from llmops.training.train import TrainRecord

log = logging.getLogger("llmops.evaluate")

HELDOUT, SCORES, SAMPLES, METRICS_FILE = "heldout.jsonl", "scores.npz", "samples.jsonl", "metrics.json"


class EvaluateFigures(Figures):
    # model ("trained", and "untrained" or "base") -> metric name -> value; names are the code's own
    metrics: dict[str, dict[str, float]]
    # model -> metric -> {"low", "high"}: the 95% bootstrap interval over the held-out examples
    intervals: dict[str, dict[str, dict[str, float]]]
    # metric -> {"gain", "low", "high"}: trained minus starting point, positive when better, paired bootstrap
    gain_over_baseline: dict[str, dict[str, float]]
    primary_metric: str
    higher_is_better: bool
    primary_reason: str
    baseline: str
    examples: int
    eval_rows: int
    heldout_md5: str

    NAMED_MAPS = ("metrics", "intervals", "gain_over_baseline")


EvaluateRecord = StageRecord[EvaluateFigures]


@dataclass
class Scored:
    """One model on a set of rows: per-example metric parts, and what it answered (generations or labels)."""

    parts: dict[str, np.ndarray]
    outputs: list[str]

    def values(self) -> dict[str, float]:
        return {name: metrics.value(name, parts) for name, parts in self.parts.items()}

    def intervals(self) -> dict[str, dict[str, float]]:
        return {name: dict(zip(("low", "high"), metrics.interval(name, parts), strict=True))
                for name, parts in self.parts.items()}


def evaluate(config: PipelineConfig, trained: TrainRecord, tokenized: TokenizeRecord,
             deduped: DedupRecord) -> EvaluateRecord:
    upstream = [trained, tokenized, deduped]
    key = keys.key_for("evaluate", config, upstream, workspace.project_root())

    def build(folder: Path) -> EvaluateFigures:
        return compare(config, trained.dir / "model", tokenized.figures.max_length, deduped.dir / "eval.jsonl",
                       folder)

    return workspace.build_artifact(EvaluateRecord, "evaluate", key, build, upstream)


def baseline_name(model_config: ModelConfig) -> str:
    return "base" if model_config.name_or_path else "untrained"


def write_heldout(eval_rows: Path, limit: int, target: Path) -> list[dict[str, Any]]:
    """The first `limit` eval rows, without the pipeline's bookkeeping fields (source file, line), so that the
    same examples give the same bytes wherever the data lives."""
    rows = []
    for row in workspace.read_jsonl(eval_rows):
        if len(rows) == limit:
            break
        rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    workspace.write_jsonl(target, rows)
    return rows


def md5_of(path: Path) -> str:
    return workspace.hash_bytes_of(path, hashlib.md5()).hexdigest()


def compare(pipeline: PipelineConfig, model_dir: Path, max_length: int, eval_rows: Path,
            folder: Path) -> EvaluateFigures:
    """The trained model and its starting point, scored on the same held-out rows."""
    from transformers import AutoTokenizer

    data, settings, seed = pipeline.data, pipeline.evaluate, pipeline.train.seed
    rows = write_heldout(eval_rows, settings.max_examples, folder / HELDOUT)
    primary, reason = metrics.choose_primary(metrics.metric_set(data.kind, data.objective), settings.primary_metric,
                                             references(rows, data.kind))
    log.info("primary metric %s: %s", primary, reason)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    baseline = baseline_name(pipeline.model)
    start = registered_base.resolved_model(pipeline.model, pipeline.tracking)
    models = {"trained": modeling.load_trained(model_dir, data.kind),
              baseline: modeling.build_model(start, tokenizer, seed, data.kind, data.labels, objective=data.objective)}
    # preference pairs: the reward margin is measured against the starting model
    models = {name: modeling.place(model).eval() for name, model in models.items()}
    reference = dpo.Reference(models[baseline], pipeline.train.preference_beta) if data.kind == "preference" else None
    scored = {name: score(model, tokenizer, rows, data, settings, max_length, reference)
              for name, model in models.items()}
    save_scores(folder, scored, rows, data.kind)
    values = {name: result.values() for name, result in scored.items()}
    (folder / METRICS_FILE).write_text(json.dumps(values, indent=2))
    gains = {name: metrics.gain(name, scored["trained"].parts[name], scored[baseline].parts[name])
             for name in scored["trained"].parts}
    return EvaluateFigures(metrics=values, intervals={name: result.intervals() for name, result in scored.items()},
                           gain_over_baseline=gains, primary_metric=primary,
                           higher_is_better=bool(metrics.METRICS[primary].higher_is_better), primary_reason=reason,
                           baseline=baseline, examples=len(rows), eval_rows=count_rows(eval_rows),
                           heldout_md5=md5_of(folder / HELDOUT))


def count_rows(path: Path) -> int:
    return sum(1 for _ in workspace.read_jsonl(path))


def references(rows: list[dict[str, Any]], kind: RecordKind) -> list[str]:
    if kind in ("instruction", "chat"):
        return [prompt_and_reference(row, kind)[1] for row in rows]
    if kind == "seq2seq":
        return [row["target"] for row in rows]
    return []


def save_scores(folder: Path, scored: dict[str, Scored], rows: list[dict[str, Any]], kind: RecordKind) -> None:
    """Per-example parts (so that a later comparison on the same rows pairs up) and samples for a person."""
    np.savez(folder / SCORES, **{f"{model}/{name}": parts for model, result in scored.items()
                                 for name, parts in result.parts.items()})
    outputs = {name: result.outputs for name, result in scored.items()}
    workspace.write_jsonl(folder / SAMPLES, samples(rows, outputs, kind))


def load_scores(folder: Path, model: str) -> dict[str, np.ndarray]:
    with np.load(folder / SCORES) as stored:
        return {name.partition("/")[2]: stored[name] for name in stored.files if name.startswith(f"{model}/")}


def score(model: Any, tokenizer: Any, rows: list[dict[str, Any]], data: DataConfig, settings: EvaluateConfig,
          max_length: int, reference: dpo.Reference | None = None) -> Scored:
    """Every metric of the record kind, per example, for one model on these rows (preference pairs: against the
    starting model `reference`)."""
    if data.kind == "preference":
        return Scored(*dpo.score(model, tokenizer, rows, max_length, settings.batch_size, reference))
    if data.kind == "tokens":
        return Scored(*token_classification.score(model, tokenizer, rows, data.labels, max_length,
                                                  settings.batch_size))
    if data.objective == "masked_lm":
        return Scored(*masked_lm.score(model, tokenizer, rows, max_length, settings.batch_size))
    if data.kind == "seq2seq":
        return Scored(*seq2seq.score(model, tokenizer, rows, settings, max_length))
    encoded = Encoder(tokenizer, data, max_length)(rows) if rows else {"input_ids": [], "labels": []}
    if data.kind == "classification":
        predicted = classify(model, tokenizer, encoded["input_ids"], settings.batch_size)
        parts = metrics.classification_parts(predicted, encoded["labels"], len(data.labels))
        return Scored(parts, [data.labels[i] for i in predicted])
    nll, tokens = token_losses(model, encoded, tokenizer.pad_token_id, settings.batch_size)
    if data.kind == "text":
        return Scored(metrics.likelihood_parts(nll, tokens, ""), [])
    texts, lengths, truncated = generate(model, tokenizer, rows, data.kind, settings)
    parts = {**metrics.likelihood_parts(nll, tokens, "completion_"),
             **metrics.generation_parts(texts, references(rows, data.kind), lengths, truncated)}
    return Scored(parts, texts)


def samples(rows: list[dict[str, Any]], outputs: dict[str, list[Any]], kind: RecordKind) -> list[dict[str, Any]]:
    """Held-out rows next to what each model made of them, for a person to read."""
    if kind == "text" and not any(outputs.values()):
        return []
    table = []
    for index, row in enumerate(rows):
        if kind == "text":  # masked LM: each model's fills of the held-out mask, in brackets
            entry = {"text": row["text"]}
        elif kind == "classification":
            entry = {"text": row["text"], "reference": str(row["label"])}
        elif kind == "tokens":
            entry = token_classification.sample(row)
        elif kind == "preference":
            entry = preference.sample_entry(row)
        elif kind == "seq2seq":
            entry = seq2seq.sample(row)
        else:
            prompt, reference = prompt_and_reference(row, kind)
            entry = {"prompt": prompt[-1]["content"], "reference": reference}
        table.append({**entry, **{f"{name}_output": values[index] for name, values in outputs.items()}})
    return table


def classify(model: Any, tokenizer: Any, ids: list[list[int]], batch_size: int) -> list[int]:
    import torch
    from transformers import DataCollatorWithPadding

    collate = DataCollatorWithPadding(tokenizer)
    predicted: list[int] = []
    with torch.no_grad():
        for start in range(0, len(ids), batch_size):
            batch = modeling.on_device(collate([{"input_ids": row} for row in ids[start:start + batch_size]]), model)
            predicted.extend(model(**batch).logits.argmax(-1).tolist())
    return predicted


def token_losses(model: Any, encoded: dict[str, list[Any]], pad_token_id: int,
                 batch_size: int) -> tuple[list[float], list[int]]:
    """Per row: the summed negative log-likelihood of its target tokens, and how many there are."""
    import torch
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    collate = DataCollatorForLanguageModeling(pad_token_id=pad_token_id)
    rows = [{"input_ids": ids, "labels": labels} for ids, labels in zip(encoded["input_ids"], encoded["labels"],
                                                                        strict=True)]
    nll: list[float] = []
    tokens: list[int] = []
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            batch = modeling.on_device(collate(rows[start:start + batch_size]), model)
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            targets = batch["labels"][:, 1:]
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2).float(), targets,
                                                     ignore_index=IGNORE_INDEX, reduction="none")
            nll.extend(loss.sum(dim=1).tolist())
            tokens.extend((targets != IGNORE_INDEX).sum(dim=1).tolist())
    return nll, tokens


def generate(model: Any, tokenizer: Any, rows: list[dict[str, Any]], kind: RecordKind,
             config: EvaluateConfig) -> tuple[list[str], list[int], list[bool]]:
    """Greedy completions of each row's last assistant turn, batched with left padding: the texts, their lengths
    in tokens, and whether each was cut at max_new_tokens before it ended."""
    import torch

    tokenizer.padding_side = "left"
    texts: list[str] = []
    lengths: list[int] = []
    truncated: list[bool] = []
    for start in range(0, len(rows), config.batch_size):
        prompts = [render(tokenizer, prompt_and_reference(row, kind)[0], generation_prompt=True)
                   for row in rows[start:start + config.batch_size]]
        batch = modeling.on_device(tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False),
                                   model)
        with torch.no_grad():
            generated = model.generate(**batch, max_new_tokens=config.max_new_tokens, do_sample=False,
                                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        new_tokens = generated[:, batch["input_ids"].shape[1]:].tolist()
        for sequence in new_tokens:
            length = sequence.index(tokenizer.eos_token_id) if tokenizer.eos_token_id in sequence else len(sequence)
            lengths.append(length)
            truncated.append(length >= config.max_new_tokens)
            texts.append(tokenizer.decode(sequence[:length], skip_special_tokens=True).strip())
    return texts, lengths, truncated

