"""Held-out metrics: their definitions, per-example parts, bootstrap intervals and the choice of the primary one.

Every metric is computed from per-example parts that add up: a mean is (value, 1) per example, the
completion loss is (summed negative log-likelihood, response tokens), macro-F1 is per-class counts.
So the point estimate, a bootstrap resample and a paired comparison of two models on the same
examples are all the same reduction of summed parts, and an interval costs one matrix product per
batch of resamples.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

MetricName = Literal["completion_loss", "completion_perplexity", "exact_match", "rouge_l", "chrf",
                     "generated_tokens", "truncation_rate", "loss", "perplexity", "accuracy", "macro_f1",
                     "entity_precision", "entity_recall", "entity_f1", "token_accuracy", "masked_accuracy",
                     "masked_loss", "masked_perplexity", "preference_accuracy", "reward_margin"]

Reduce = Callable[[np.ndarray], np.ndarray]


def ratio(sums: np.ndarray) -> np.ndarray:
    """Column 0 over column 1, per row of summed parts; NaN where nothing was counted."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(sums[:, 1] > 0, sums[:, 0] / sums[:, 1], np.nan)


def exp_ratio(sums: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.exp(ratio(sums))


def macro_f1(sums: np.ndarray) -> np.ndarray:
    """Parts are per-class (true positives, predicted, actual); F1 = 2·tp / (predicted + actual), averaged over
    the classes that occur in the predictions or the truth, as scikit-learn's macro average does."""
    classes = sums.shape[1] // 3
    tp, predicted, actual = sums[:, :classes], sums[:, classes:2 * classes], sums[:, 2 * classes:]
    with np.errstate(divide="ignore", invalid="ignore"):
        f1 = np.where(predicted + actual > 0, 2 * tp / (predicted + actual), np.nan)
    counted = np.isfinite(f1).sum(axis=1)
    return np.where(counted > 0, np.nansum(f1, axis=1) / np.maximum(counted, 1), np.nan)


def entity_ratio(numerator: Callable[[np.ndarray], np.ndarray],
                 denominator: Callable[[np.ndarray], np.ndarray]) -> Reduce:
    """A ratio of summed entity counts, whose parts are (true positives, predicted, actual) per example."""
    def reduce(sums: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(denominator(sums) > 0, numerator(sums) / denominator(sums), np.nan)
    return reduce


@dataclass(frozen=True)
class Metric:
    reduce: Reduce
    # None: no better direction (a length); such a metric is reported, never a primary or a guard
    higher_is_better: bool | None
    description: str


METRICS: dict[str, Metric] = {
    "completion_loss": Metric(ratio, False, "mean negative log-likelihood of the response tokens"),
    "completion_perplexity": Metric(exp_ratio, False, "exp of the completion loss"),
    "exact_match": Metric(ratio, True, "share of generated answers equal to the reference"),
    "rouge_l": Metric(ratio, True, "ROUGE-L F1 of generated answers (longest common word subsequence)"),
    "chrf": Metric(ratio, True, "chrF of generated answers (sacrebleu, 0-100)"),
    "generated_tokens": Metric(ratio, None, "mean length of generated answers in tokens"),
    "truncation_rate": Metric(ratio, False, "share of generations cut at evaluate.max_new_tokens"),
    "loss": Metric(ratio, False, "mean negative log-likelihood per token"),
    "perplexity": Metric(exp_ratio, False, "exp of the loss"),
    "accuracy": Metric(ratio, True, "share of rows given their label"),
    "macro_f1": Metric(macro_f1, True, "F1 averaged over labels"),
    "entity_precision": Metric(entity_ratio(lambda s: s[:, 0], lambda s: s[:, 1]), True,
                               "share of predicted entities (exact span and type) that are in the reference"),
    "entity_recall": Metric(entity_ratio(lambda s: s[:, 0], lambda s: s[:, 2]), True,
                            "share of reference entities (exact span and type) that are predicted"),
    "entity_f1": Metric(entity_ratio(lambda s: 2 * s[:, 0], lambda s: s[:, 1] + s[:, 2]), True,
                        "F1 of entity precision and recall, over all entities"),
    "token_accuracy": Metric(ratio, True, "share of words given their tag"),
    "masked_accuracy": Metric(ratio, True, "share of the held-out mask's hidden tokens restored (top-1)"),
    "masked_loss": Metric(ratio, False, "mean negative log-likelihood of the held-out mask's hidden tokens"),
    "masked_perplexity": Metric(exp_ratio, False, "exp of the masked-token loss"),
    "preference_accuracy": Metric(ratio, True, "share of pairs whose chosen answer is likelier than the rejected one"),
    "reward_margin": Metric(ratio, True, "mean DPO reward of the chosen answer over the rejected one, against the "
                            "starting model"),
}

GENERATIVE = ("completion_loss", "completion_perplexity", "exact_match", "rouge_l", "chrf", "generated_tokens",
              "truncation_rate")
BY_KIND: dict[str, tuple[str, ...]] = {"instruction": GENERATIVE, "chat": GENERATIVE,
                                       "text": ("loss", "perplexity"), "classification": ("accuracy", "macro_f1"),
                                       "tokens": ("entity_f1", "entity_precision", "entity_recall",
                                                  "token_accuracy"),
                                       "preference": ("preference_accuracy", "reward_margin"),
                                       # a target written from a source is scored as a response is
                                       "seq2seq": GENERATIVE,
                                       # plain text with data.objective=masked_lm
                                       "masked_lm": ("masked_accuracy", "masked_loss", "masked_perplexity")}
# reference answers this short (p95, in words) are closed answers: exact match tells models apart
SHORT_ANSWER_WORDS = 8
BOOTSTRAP_SAMPLES = 1000
BOOTSTRAP_SEED = 0


def metric_set(kind: str, objective: str) -> str:
    """The BY_KIND key of a record kind trained with an objective: masked LM reports its own metrics."""
    return "masked_lm" if objective == "masked_lm" else kind


def directed(kind: str) -> tuple[str, ...]:
    """The metrics of a record kind that can decide between models."""
    return tuple(name for name in BY_KIND[kind] if METRICS[name].higher_is_better is not None)


def value(name: str, parts: np.ndarray) -> float:
    return float(METRICS[name].reduce(parts.sum(axis=0, keepdims=True))[0]) if len(parts) else float("nan")


@functools.lru_cache(maxsize=4)
def resample_weights(examples: int, samples: int = BOOTSTRAP_SAMPLES, seed: int = BOOTSTRAP_SEED,
                     batch: int = 100) -> tuple[np.ndarray, ...]:
    """How often each example is drawn in each bootstrap resample, in batches of resamples: (batch, examples)."""
    rng = np.random.default_rng(seed)
    uniform = np.full(examples, 1 / examples)
    return tuple(rng.multinomial(examples, uniform, size=min(batch, samples - start)).astype(float)
                 for start in range(0, samples, batch))


def resampled(name: str, parts: np.ndarray) -> np.ndarray:
    """The metric on each bootstrap resample of the examples (the same resamples for every metric and model of
    this many examples, so that two models' values pair up)."""
    reduce = METRICS[name].reduce
    return np.concatenate([reduce(weights @ parts) for weights in resample_weights(len(parts))])


def interval(name: str, parts: np.ndarray) -> tuple[float, float]:
    """The 95% percentile bootstrap interval of the metric over the examples."""
    if len(parts) == 0:
        return float("nan"), float("nan")
    low, high = np.nanpercentile(resampled(name, parts), [2.5, 97.5])
    return float(low), float(high)


def gain(name: str, candidate: np.ndarray, reference: np.ndarray) -> dict[str, float]:
    """How much better the candidate is than the reference on the same examples (positive: better), with the
    95% interval of a paired bootstrap."""
    sign = 1.0 if METRICS[name].higher_is_better is not False else -1.0
    point = sign * (value(name, candidate) - value(name, reference))
    if len(candidate) == 0:
        return {"gain": point, "low": float("nan"), "high": float("nan")}
    differences = sign * (resampled(name, candidate) - resampled(name, reference))
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


def classification_parts(predicted: list[int], truth: list[int], classes: int) -> dict[str, np.ndarray]:
    hits = [float(p == t) for p, t in zip(predicted, truth, strict=True)]
    eye = np.eye(classes)
    predicted_onehot, truth_onehot = eye[predicted].reshape(-1, classes), eye[truth].reshape(-1, classes)
    return {"accuracy": means(hits),
            "macro_f1": np.hstack([predicted_onehot * truth_onehot, predicted_onehot, truth_onehot])}


def word_count_p95(references: list[str]) -> float:
    return float(np.percentile([len(text.split()) for text in references], 95)) if references else 0.0


def choose_primary(kind: str, configured: str | None, references: list[str]) -> tuple[str, str]:
    """The metric that decides between models, and why it was chosen."""
    if configured:
        return configured, "set by evaluate.primary_metric"
    if kind == "text":
        return "perplexity", "plain text: how well the model predicts held-out text"
    if kind == "masked_lm":
        return "masked_accuracy", ("masked LM: the share of hidden held-out tokens restored, what a fill-mask user "
                                   "sees first; bounded and read without a tokenizer's vocabulary size in mind")
    if kind == "classification":
        return "macro_f1", "classification: F1 averaged over labels, so rare labels count"
    if kind == "tokens":
        return "entity_f1", "token classification: entities found with their exact span and type"
    if kind == "preference":
        return "preference_accuracy", ("preference pairs: how often the model finds the chosen answer likelier than "
                                       "the rejected one, whichever model it started from")
    p95 = word_count_p95(references)
    if p95 <= SHORT_ANSWER_WORDS:
        return "exact_match", (f"reference answers are short (p95 {p95:g} words <= {SHORT_ANSWER_WORDS}): an answer "
                               "is right or wrong")
    return "rouge_l", (f"reference answers are long (p95 {p95:g} words > {SHORT_ANSWER_WORDS}): exact match cannot "
                       "tell models apart; ROUGE-L of generations compares versions whatever their tokenizer")
