"""Evaluate: the trained model and its starting point, on the same held-out examples, with 95% intervals.

The held-out examples are the first `evaluate.max_examples` rows of the eval split (written to
`heldout.jsonl`: the set a registered model name pins as its frozen evaluation set). The selected
objective scores each model on them (objectives/: its metrics, per example) and chooses the primary
metric; the starting point is the untrained model (same random init as training) or the base
pretrained model. Each metric gets a bootstrap interval over the examples, and the trained model's
gain over its starting point a paired one. Scoring takes rows and a model, so the register stage
scores a registered champion the same way.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from llmops.config.evaluation import metric_key
from llmops.config.schema import ModelConfig, PipelineConfig
from llmops.data.dedup import DedupRecord
from llmops.data.tokenize import TokenizeRecord
from llmops.evaluation import benchmarks
from llmops.io.figures import Figures
from llmops.io.files import hash_bytes_of, read_jsonl, write_jsonl
from llmops.io.tables import table_index, table_rows
from llmops.models import modeling
from llmops.objectives import selected
from llmops.objectives.base import Encoding, ScoringContext
from llmops.objectives.metrics import MetricTable, Scored, gain
from llmops.pipeline.stages import StageContext
from llmops.records.base import RecordKind
from llmops.store.artifacts import StageRecord
from llmops.training.session import TrainRecord

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
    # model -> lm-eval task -> its main metric's {metric, higher_is_better, score, stderr, low, high, samples}
    benchmarks: dict[str, dict[str, dict[str, Any]]] = {}

    NAMED_MAPS = ("metrics", "intervals", "gain_over_baseline")

    def loggable(self) -> dict[str, float]:
        """The figures, and each benchmark's score, error and interval under its task's metric key."""
        flat = super().loggable()
        for model, tasks in self.benchmarks.items():
            for task, score in tasks.items():
                flat.update({f"benchmarks.{model}.{metric_key(task)}.{field}": float(score[field])
                             for field in ("score", "stderr", "low", "high")})
        return flat


EvaluateRecord = StageRecord[EvaluateFigures]


def evaluate(config: PipelineConfig, trained: TrainRecord, tokenized: TokenizeRecord, deduped: DedupRecord,
             context: StageContext) -> EvaluateFigures:
    return compare(config, trained.dir / "model", tokenized.figures.max_length, deduped.dir / "eval",
                   context.folder)


def baseline_name(model_config: ModelConfig) -> str:
    return "base" if model_config.name_or_path else "untrained"


def write_heldout(eval_rows: Path, limit: int, target: Path) -> list[dict[str, Any]]:
    """The first `limit` rows of the eval table, without the pipeline's bookkeeping fields (source file, line), so
    that the same examples give the same bytes wherever the data lives."""
    rows = []
    for row in table_rows(eval_rows):
        if len(rows) == limit:
            break
        rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    write_jsonl(target, rows)
    return rows


def md5_of(path: Path) -> str:
    return hash_bytes_of(path, hashlib.md5()).hexdigest()


def scoring_context(config: PipelineConfig, max_length: int, reference: Any = None) -> ScoringContext:
    """How every model of this config is scored: the evaluate settings and the run's encoding."""
    return ScoringContext(settings=config.evaluate, reference=reference,
                          encoding=Encoding(max_length, tuple(config.data.labels), config.tokenize.stride))


def compare(pipeline: PipelineConfig, model_dir: Path, max_length: int, eval_rows: Path,
            folder: Path) -> EvaluateFigures:
    """The trained model and its starting point, scored on the same held-out rows."""
    from transformers import AutoTokenizer

    objective, settings = selected(pipeline.data), pipeline.evaluate
    rows = write_heldout(eval_rows, settings.max_examples, folder / HELDOUT)
    primary, reason = objective.primary(settings.primary_metric, rows)
    log.info("primary metric %s: %s", primary, reason)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    baseline = baseline_name(pipeline.model)
    models = {"trained": objective.load_trained(model_dir),
              baseline: objective.build_model(pipeline.model, tokenizer, pipeline.train.seed, pipeline.data.labels)}
    models = {name: modeling.place(model).eval() for name, model in models.items()}
    start = objective.reference(models[baseline], pipeline) if objective.measured_against_start else None
    context = scoring_context(pipeline, max_length, start)
    scored = {name: objective.score(model, tokenizer, rows, context) for name, model in models.items()}
    save_scores(folder, scored, rows, objective.kind)
    values = {name: result.values() for name, result in scored.items()}
    (folder / METRICS_FILE).write_text(json.dumps(values, indent=2))
    gains = {name: gain(objective.metrics[name], scored["trained"].parts[name], scored[baseline].parts[name])
             for name in scored["trained"].parts}
    return EvaluateFigures(benchmarks=run_benchmarks(pipeline, models, tokenizer, folder),
                           metrics=values, intervals={name: result.intervals() for name, result in scored.items()},
                           gain_over_baseline=gains, primary_metric=primary,
                           higher_is_better=bool(objective.metrics[primary].higher_is_better), primary_reason=reason,
                           baseline=baseline, examples=len(rows), eval_rows=table_index(eval_rows)["rows"],
                           heldout_md5=md5_of(folder / HELDOUT))


def run_benchmarks(pipeline: PipelineConfig, models: dict[str, Any], tokenizer: Any,
                   folder: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """evaluate.benchmarks on every model compared (the trained one and its starting point), kept beside the scores."""
    if not pipeline.evaluate.benchmarks:
        return {}
    backend = selected(pipeline.data).benchmark_backend or "causal"  # the objective's check refuses benchmarks else
    specs = benchmarks.task_specs(pipeline.evaluate)
    scores = {name: benchmarks.run(model, tokenizer, specs, pipeline.evaluate, backend)
              for name, model in models.items()}
    benchmarks.write(folder, scores)
    return scores


def save_scores(folder: Path, scored: dict[str, Scored], rows: list[dict[str, Any]], kind: RecordKind) -> None:
    """Per-example parts (so that a later comparison on the same rows pairs up) and samples for a person."""
    np.savez(folder / SCORES, **{f"{model}/{name}": parts for model, result in scored.items()
                                 for name, parts in result.parts.items()})
    outputs = {name: result.outputs for name, result in scored.items()}
    write_jsonl(folder / SAMPLES, samples(rows, outputs, kind))


def load_scores(folder: Path, model: str, metrics: MetricTable) -> Scored:
    """One model's stored scores of an evaluate artifact, with what it answered."""
    with np.load(folder / SCORES) as stored:
        parts = {name.partition("/")[2]: stored[name] for name in stored.files if name.startswith(f"{model}/")}
    outputs = [sample.get(f"{model}_output", "") for sample in read_jsonl(folder / SAMPLES)]
    return Scored(parts, outputs, metrics)


def samples(rows: list[dict[str, Any]], outputs: dict[str, list[Any]], kind: RecordKind) -> list[dict[str, Any]]:
    """Held-out rows next to what each model made of them, for a person to read (none where no model answers
    anything: a language model of plain text is scored on likelihood only)."""
    if not any(outputs.values()):
        return []
    return [{**kind.sample(row), **{f"{name}_output": values[index] for name, values in outputs.items()}}
            for index, row in enumerate(rows)]
