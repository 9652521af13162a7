"""Evaluation that tells models apart, on models trained here."""

from pathlib import Path

import pytest

from tasks.evaluate import evaluate
from tasks.synthetic import glossary_records
from tasks.train import train
from tasks.workspace import write_jsonl
from tests.conftest import tiny_config
from tests.unit.helpers import data_stages

pytestmark = pytest.mark.slow


def test_long_form_answers_are_judged_by_rouge_l_which_separates_trained_from_untrained(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "glossary.jsonl", glossary_records(500, seed=11))
    config = tiny_config("tiny_sft_cpu.yaml", tmp_path / "glossary.jsonl", "tokenize.vocab_size=512",
                         "tokenize.max_length=64", "train.max_steps=40", "train.batch_size=16",
                         "train.learning_rate=1e-2", "evaluate.max_new_tokens=40", "evaluate.max_examples=40")
    deduped, tokenized = data_stages(config)
    figures = evaluate(config, train(config, tokenized), tokenized, deduped).figures
    assert figures.primary_metric == "rouge_l"
    assert figures.primary_reason.startswith("reference answers are long (p95 2")
    trained, untrained = figures.intervals["trained"], figures.intervals["untrained"]
    assert trained["rouge_l"]["low"] > untrained["rouge_l"]["high"]  # intervals that do not overlap
    assert figures.metrics["trained"]["exact_match"] == figures.metrics["untrained"]["exact_match"] == 0.0
    assert figures.gain_over_baseline["rouge_l"]["low"] > 0
    assert figures.metrics["trained"]["chrf"] > figures.metrics["untrained"]["chrf"]
    assert figures.metrics["trained"]["completion_loss"] < figures.metrics["untrained"]["completion_loss"]
    assert figures.metrics["trained"]["truncation_rate"] < figures.metrics["untrained"]["truncation_rate"]
