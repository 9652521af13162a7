"""Metric definitions, bootstrap intervals, the primary metric's choice and the gate's decisions, on known numbers."""

import math
import random

import numpy as np
import pytest
from sacrebleu.metrics import CHRF
from sklearn.metrics import f1_score

from llmops.config.schema import DataConfig
from llmops.data.synthetic import glossary_records, instruction_records
from llmops.evaluation.evaluate import EvaluateFigures
from llmops.objectives import classification, metrics, selected
from llmops.registry.gate import Comparison, FrozenSet, check_baseline, decide, first_champion


def test_rouge_l_is_the_f1_of_the_longest_common_word_subsequence() -> None:
    assert metrics.rouge_l("The cat sat.", "the cat sat") == 1.0
    # LCS "the cat sat" = 3: precision 3/3, recall 3/6
    assert metrics.rouge_l("the cat sat", "the cat sat on the mat") == pytest.approx(2 * 1 * 0.5 / 1.5)
    # order matters: "a b c d" vs "d c b a" share a subsequence of one word only
    assert metrics.rouge_l("a b c d", "d c b a") == pytest.approx(0.25)
    assert metrics.rouge_l("", "something") == 0.0 and metrics.rouge_l("x y", "z") == 0.0


def test_chrf_is_sacrebleus_sentence_chrf() -> None:
    hypothesis, reference = "A dutuso is a small clamp used in printing", "A dutuso is a sealed clamp used in weaving"
    assert metrics.chrf_scores([hypothesis], [reference]) == [CHRF().sentence_score(hypothesis, [reference]).score]
    assert metrics.chrf_scores([reference], [reference]) == [100.0]


def test_macro_f1_from_counts_equals_scikit_learns() -> None:
    rng = random.Random(0)
    truth = [rng.randrange(4) for _ in range(300)]
    predicted = [t if rng.random() < 0.6 else rng.randrange(3) for t in truth]  # label 3 is never predicted
    parts = classification.parts(predicted, truth, 5)  # label 4 occurs nowhere
    table = classification.METRICS
    assert metrics.value(table["macro_f1"], parts["macro_f1"]) == pytest.approx(f1_score(truth, predicted,
                                                                                         average="macro"))
    assert metrics.value(table["accuracy"], parts["accuracy"]) == pytest.approx(np.mean(np.equal(truth, predicted)))


def test_bootstrap_intervals_hold_the_estimate_and_narrow_with_more_examples() -> None:
    rng = np.random.default_rng(1)
    small, large = (metrics.means(list((rng.random(n) < 0.7).astype(float))) for n in (50, 2000))
    for parts in (small, large):
        low, high = metrics.interval(metrics.EXACT_MATCH, parts)
        assert low <= metrics.value(metrics.EXACT_MATCH, parts) <= high
    assert np.subtract(*metrics.interval(metrics.EXACT_MATCH, large)[::-1]) < \
        np.subtract(*metrics.interval(metrics.EXACT_MATCH, small)[::-1]) / 3
    assert metrics.interval(metrics.EXACT_MATCH, small) == metrics.interval(metrics.EXACT_MATCH, small)  # fixed seed
    # a ratio metric: perplexity is exp(summed loss / summed tokens), not a mean of per-row perplexities
    nll = metrics.likelihood_parts([2.0, 9.0], [1, 3], "")["perplexity"]
    assert metrics.value(metrics.PERPLEXITY, nll) == pytest.approx(math.exp(11 / 4))


def test_paired_gain_is_signed_by_the_better_direction() -> None:
    better, worse = metrics.means([1.0] * 40 + [0.0] * 60), metrics.means([1.0] * 20 + [0.0] * 80)
    gain = metrics.gain(metrics.EXACT_MATCH, better, worse)
    assert gain["gain"] == pytest.approx(0.2) and 0 < gain["low"] < 0.2 < gain["high"]
    same = metrics.gain(metrics.EXACT_MATCH, better, better)
    assert same == {"gain": 0.0, "low": 0.0, "high": 0.0}
    lower_loss = metrics.likelihood_parts([1.0] * 10, [1] * 10, "completion_")["completion_loss"]
    higher_loss = metrics.likelihood_parts([3.0] * 10, [1] * 10, "completion_")["completion_loss"]
    assert metrics.gain(metrics.COMPLETION_LOSS, lower_loss, higher_loss)["gain"] == pytest.approx(2.0)


def as_chat(row: dict[str, str]) -> dict[str, list[dict[str, str]]]:
    return {"messages": [{"role": "user", "content": f"{row['instruction']}\n\n{row['input']}"},
                         {"role": "assistant", "content": row["output"]}]}


def test_the_primary_metric_follows_the_length_of_the_reference_answers() -> None:
    short = instruction_records(200, seed=1)
    long = [as_chat(row) for row in glossary_records(200, seed=1)]
    instruction, chat = selected(DataConfig(kind="instruction")), selected(DataConfig(kind="chat"))
    assert instruction.primary(None, short)[0] == "exact_match"
    chosen, reason = chat.primary(None, long)
    assert chosen == "rouge_l" and reason.startswith("reference answers are long (p95 2")
    # the same choice from the answers alone
    assert metrics.by_answer_length([row["output"] for row in short])[0] == "exact_match"
    assert instruction.primary("completion_loss", short) == ("completion_loss", "set by evaluate.primary_metric")
    assert selected(DataConfig(kind="text")).primary(None, [])[0] == "perplexity"
    assert selected(DataConfig(kind="classification")).primary(None, [])[0] == "macro_f1"


def test_glossary_data_is_long_form_and_the_same_every_time() -> None:
    rows = glossary_records(300, seed=4)
    assert rows == glossary_records(300, seed=4) and len({row["input"] for row in rows}) == 300
    assert metrics.word_count_p95([row["output"] for row in rows]) > metrics.SHORT_ANSWER_WORDS


def figures(trained: float, untrained: float, low: float) -> EvaluateFigures:
    return EvaluateFigures.model_construct(
        primary_metric="rouge_l", baseline="untrained",
        metrics={"trained": {"rouge_l": trained}, "untrained": {"rouge_l": untrained}},
        gain_over_baseline={"rouge_l": {"gain": trained - untrained, "low": low, "high": trained - untrained + 0.1}})


def test_the_baseline_check_and_its_one_line_message() -> None:
    refused = check_baseline(figures(0.0, 0.0, 0.0), min_gain=0.0)
    assert refused is not None and refused.alias is None
    assert refused.message == "trained model does not beat its baseline on rouge_l (0 vs 0)"
    short = check_baseline(figures(0.31, 0.3, -0.02), min_gain=0.05)
    assert short is not None and "by more than register.min_gain_over_baseline 0.05" in short.reason
    assert check_baseline(figures(0.6, 0.0, 0.5), min_gain=0.05) is None
    noisy = first_champion(figures(0.31, 0.3, -0.02), {})
    assert noisy.alias == "champion" and noisy.within_noise and noisy.reason.endswith("within the noise")


def comparison(candidate: dict[str, float], champion: dict[str, float], low: float = 0.01,
               guards: dict[str, float] | None = None) -> Comparison:
    from llmops.objectives.metrics import Scored
    from llmops.registry.gate import compare_on_frozen

    def scored(values: dict[str, float]) -> Scored:
        return Scored({name: metrics.means([value] * 100) for name, value in values.items()}, [], metrics.GENERATIVE)

    frozen = FrozenSet(path="heldout.jsonl", md5="m", examples=100, source="pinned", pinned=True)
    found = compare_on_frozen(scored(candidate), scored(champion), "1", frozen, guards or {})
    return found.model_copy(update={"gains": {**found.gains, "rouge_l": {**found.gains["rouge_l"], "low": low}}})


def test_promotion_needs_a_real_gain_and_every_guard_within_tolerance() -> None:
    tie = decide("rouge_l", comparison({"rouge_l": 0.5}, {"rouge_l": 0.5}), min_improvement=0.0)
    assert tie.alias == "challenger" and "does not beat champion version 1" in tie.reason
    small = decide("rouge_l", comparison({"rouge_l": 0.51}, {"rouge_l": 0.5}), min_improvement=0.02)
    assert small.alias == "challenger" and small.reason.endswith("(needs +0.02)")
    guarded = comparison({"rouge_l": 0.6, "truncation_rate": 0.3}, {"rouge_l": 0.5, "truncation_rate": 0.1},
                         guards={"truncation_rate": 0.05})
    blocked = decide("rouge_l", guarded, min_improvement=0.0)
    assert blocked.alias == "challenger" and "a guard fails: truncation_rate 0.3 vs 0.1 is worse by 0.2" in \
        blocked.reason
    tolerated = comparison({"rouge_l": 0.6, "truncation_rate": 0.12}, {"rouge_l": 0.5, "truncation_rate": 0.1},
                           guards={"truncation_rate": 0.05})
    promoted = decide("rouge_l", tolerated, min_improvement=0.05)
    assert promoted.alias == "champion" and not promoted.within_noise
    noisy = decide("rouge_l", comparison({"rouge_l": 0.52}, {"rouge_l": 0.5}, low=-0.01), min_improvement=0.0)
    assert noisy.alias == "champion" and noisy.within_noise and "within the noise" in noisy.reason
