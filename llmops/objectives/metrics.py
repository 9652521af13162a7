"""Held-out metrics: their definitions, per-example parts, bootstrap intervals and paired gains.

Every metric is computed from per-example parts that add up: a mean is (value, 1) per example, a
loss is (summed negative log-likelihood, target tokens), macro-F1 is per-class counts. So the
point estimate, a bootstrap resample and a paired comparison of two models on the same examples
are all the same reduction of summed parts, and an interval costs one matrix product per batch of
resamples. Each objective names the metrics it reports (objectives/); the definitions that several
objectives share live here.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from llmops.config.schema import PipelineConfig

Reduce = Callable[[np.ndarray], np.ndarray]
# reference answers this short (p95, in words) are closed answers: exact match tells models apart
SHORT_ANSWER_WORDS = 8
BOOTSTRAP_SAMPLES = 1000
BOOTSTRAP_SEED = 0


def ratio(sums: np.ndarray) -> np.ndarray:
    """Column 0 over column 1, per row of summed parts; NaN where nothing was counted."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(sums[:, 1] > 0, sums[:, 0] / sums[:, 1], np.nan)


def exp_ratio(sums: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.exp(ratio(sums))


@dataclass(frozen=True)
class Metric:
    name: str
    reduce: Reduce
    # None: no better direction (a length); such a metric is reported, never a primary or a guard
    higher_is_better: bool | None
    description: str


MetricTable = Mapping[str, Metric]


def table(*metrics: Metric) -> dict[str, Metric]:
    """Metrics by name, in the order given (the order tables and cards show them)."""
    return {metric.name: metric for metric in metrics}


def directed(metrics: MetricTable) -> tuple[str, ...]:
    """The metrics that can decide between models."""
    return tuple(name for name, metric in metrics.items() if metric.higher_is_better is not None)


def named_metric_problems(config: PipelineConfig, metrics: MetricTable, objective: str) -> list[tuple[str, str]]:
    """The metrics the config names (the primary one, the guarded ones) that the objective cannot decide on."""
    allowed = directed(metrics)
    named = [("evaluate.primary_metric", config.evaluate.primary_metric)]
    named += [(f"register.guards.{name}", name) for name in config.registry.metric_guards()]
    return [(where, f"{name} {'has no better direction' if name in metrics else f'is not reported by {objective}'}; "
                    f"expected one of: {', '.join(allowed)}")
            for where, name in named if name is not None and name not in allowed]


LOSS = Metric("loss", ratio, False, "mean negative log-likelihood per token")
PERPLEXITY = Metric("perplexity", exp_ratio, False, "exp of the loss")
COMPLETION_LOSS = Metric("completion_loss", ratio, False, "mean negative log-likelihood of the response tokens")
COMPLETION_PERPLEXITY = Metric("completion_perplexity", exp_ratio, False, "exp of the completion loss")
EXACT_MATCH = Metric("exact_match", ratio, True, "share of generated answers equal to the reference")
ROUGE_L = Metric("rouge_l", ratio, True, "ROUGE-L F1 of generated answers (longest common word subsequence)")
CHRF = Metric("chrf", ratio, True, "chrF of generated answers (sacrebleu, 0-100)")
GENERATED_TOKENS = Metric("generated_tokens", ratio, None, "mean length of generated answers in tokens")
TRUNCATION_RATE = Metric("truncation_rate", ratio, False, "share of generations cut at evaluate.max_new_tokens")
# a generated answer scored against a reference: instruction and chat SFT, seq2seq
GENERATIVE = table(COMPLETION_LOSS, COMPLETION_PERPLEXITY, EXACT_MATCH, ROUGE_L, CHRF, GENERATED_TOKENS,
                   TRUNCATION_RATE)


@dataclass
class Scored:
    """One model on a set of rows: per-example metric parts, what it answered, and the metrics' definitions."""

    parts: dict[str, np.ndarray]
    outputs: list[str]
    metrics: MetricTable = field(repr=False)

    def values(self) -> dict[str, float]:
        return {name: value(self.metrics[name], parts) for name, parts in self.parts.items()}

    def intervals(self) -> dict[str, dict[str, float]]:
        return {name: dict(zip(("low", "high"), interval(self.metrics[name], parts), strict=True))
                for name, parts in self.parts.items()}


def value(metric: Metric, parts: np.ndarray) -> float:
    return float(metric.reduce(parts.sum(axis=0, keepdims=True))[0]) if len(parts) else float("nan")


@functools.lru_cache(maxsize=4)
def resample_weights(examples: int, samples: int = BOOTSTRAP_SAMPLES, seed: int = BOOTSTRAP_SEED,
                     batch: int = 100) -> tuple[np.ndarray, ...]:
    """How often each example is drawn in each bootstrap resample, in batches of resamples: (batch, examples)."""
    rng = np.random.default_rng(seed)
    uniform = np.full(examples, 1 / examples)
    return tuple(rng.multinomial(examples, uniform, size=min(batch, samples - start)).astype(float)
                 for start in range(0, samples, batch))


def resampled(metric: Metric, parts: np.ndarray) -> np.ndarray:
    """The metric on each bootstrap resample of the examples (the same resamples for every metric and model of
    this many examples, so that two models' values pair up)."""
    return np.concatenate([metric.reduce(weights @ parts) for weights in resample_weights(len(parts))])


def interval(metric: Metric, parts: np.ndarray) -> tuple[float, float]:
    """The 95% percentile bootstrap interval of the metric over the examples."""
    if len(parts) == 0:
        return float("nan"), float("nan")
    low, high = np.nanpercentile(resampled(metric, parts), [2.5, 97.5])
    return float(low), float(high)


def gain(metric: Metric, candidate: np.ndarray, reference: np.ndarray) -> dict[str, float]:
    """How much better the candidate is than the reference on the same examples (positive: better), with the
    95% interval of a paired bootstrap."""
    sign = 1.0 if metric.higher_is_better is not False else -1.0
    point = sign * (value(metric, candidate) - value(metric, reference))
    if len(candidate) == 0:
        return {"gain": point, "low": float("nan"), "high": float("nan")}
    differences = sign * (resampled(metric, candidate) - resampled(metric, reference))
    low, high = np.nanpercentile(differences, [2.5, 97.5])
    return {"gain": point, "low": float(low), "high": float(high)}


def words(text: str) -> list[str]:
    """Lower-cased alphanumeric words, as ROUGE tokenizes."""
    return re.findall(r"[a-z0-9]+", text.lower())


def lcs_length(a: list[str], b: list[str]) -> int:
    previous = [0] * (len(b) + 1)
    for token in a:
        current = [0]
        for j, other in enumerate(b):
            current.append(previous[j] + 1 if token == other else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def exact_matches(predictions: list[str], references: list[str]) -> list[float]:
    """1 where the answer is the reference, surrounding whitespace aside."""
    return [float(p.strip() == r.strip()) for p, r in zip(predictions, references, strict=True)]


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 over words: the longest common subsequence against both lengths."""
    predicted, expected = words(prediction), words(reference)
    if not predicted or not expected:
        return float(predicted == expected)
    common = lcs_length(predicted, expected)
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


def chrf_scores(predictions: list[str], references: list[str]) -> list[float]:
    """Sentence-level chrF (sacrebleu's defaults: character 6-grams, beta 2), 0-100."""
    from sacrebleu.metrics import CHRF

    scorer = CHRF()
    return [scorer.sentence_score(p, [r]).score for p, r in zip(predictions, references, strict=True)]


def means(values: list[float]) -> np.ndarray:
    """Parts of a per-example mean."""
    return np.column_stack([np.asarray(values, dtype=float), np.ones(len(values))]) if values else np.zeros((0, 2))


def generation_parts(predictions: list[str], references: list[str], lengths: list[int],
                     truncated: list[bool]) -> dict[str, np.ndarray]:
    return {
        "exact_match": means(exact_matches(predictions, references)),
        "rouge_l": means([rouge_l(p, r) for p, r in zip(predictions, references, strict=True)]),
        "chrf": means(chrf_scores(predictions, references)),
        "generated_tokens": means([float(n) for n in lengths]),
        "truncation_rate": means([float(t) for t in truncated]),
    }


def likelihood_parts(nll: list[float], tokens: list[int], prefix: str) -> dict[str, np.ndarray]:
    """Per-example (summed negative log-likelihood, target tokens): the loss and its perplexity."""
    parts = np.column_stack([np.asarray(nll, dtype=float), np.asarray(tokens, dtype=float)]) if nll \
        else np.zeros((0, 2))
    return {f"{prefix}loss": parts, f"{prefix}perplexity": parts}


def word_count_p95(references: list[str]) -> float:
    return float(np.percentile([len(text.split()) for text in references], 95)) if references else 0.0


def by_answer_length(references: list[str]) -> tuple[str, str]:
    """Exact match for closed answers, ROUGE-L for long ones: the primary metric of generated answers."""
    p95 = word_count_p95(references)
    if p95 <= SHORT_ANSWER_WORDS:
        return "exact_match", (f"reference answers are short (p95 {p95:g} words <= {SHORT_ANSWER_WORDS}): an answer "
                               "is right or wrong")
    return "rouge_l", (f"reference answers are long (p95 {p95:g} words > {SHORT_ANSWER_WORDS}): exact match cannot "
                       "tell models apart; ROUGE-L of generations compares versions whatever their tokenizer")
