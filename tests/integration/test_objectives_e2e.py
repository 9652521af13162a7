"""Every objective learns, with full fine-tuning and with LoRA: the held-out metric beats the starting point (slow:
each test trains a model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmops.config.schema import PipelineConfig
from llmops.data.synthetic import chat_records, classification_records
from llmops.io.files import write_jsonl
from tests.conftest import tiny_config
from tests.helpers import data_stages, stage

pytestmark = pytest.mark.slow

# conversations are longer than single instructions: room for them, and for their longest answers
CHAT = ("tokenize.max_length=64", "train.epochs=10", "evaluate.max_new_tokens=32")


def learned(config: PipelineConfig) -> tuple[dict, dict, dict]:
    deduped, tokenized = data_stages(config)
    trained = stage("train", config, tokenized)
    evaluated = stage("evaluate", config, trained, tokenized, deduped)
    metrics = evaluated.figures.metrics
    baseline = metrics["base" if config.model.name_or_path else "untrained"]
    return metrics["trained"], baseline, trained.figures


def lora(base: Path) -> list[str]:
    return [f"model.name_or_path={base}", "model.adapter=lora", "model.lora.r=8", "train.learning_rate=1e-2"]


@pytest.fixture
def chat_file(tmp_path: Path) -> Path:
    write_jsonl(tmp_path / "chat.jsonl", chat_records(1200, seed=3))
    return tmp_path / "chat.jsonl"


@pytest.fixture
def labelled_file(tmp_path: Path) -> Path:
    write_jsonl(tmp_path / "labels.jsonl", classification_records(900, seed=3))
    return tmp_path / "labels.jsonl"


def test_chat_sft_from_scratch(chat_file: Path) -> None:
    trained, untrained, _ = learned(tiny_config("tiny_sft_cpu.yaml", chat_file, "data.kind=chat", *CHAT))
    assert trained["completion_perplexity"] < untrained["completion_perplexity"] / 10
    assert trained["exact_match"] > untrained["exact_match"]


def test_classification_from_scratch(labelled_file: Path) -> None:
    trained, untrained, stats = learned(tiny_config("tiny_classify_cpu.yaml", labelled_file))
    assert trained["macro_f1"] > 0.9 > untrained["macro_f1"]
    assert trained["accuracy"] > untrained["accuracy"]
    assert not stats.packed


def test_pretraining_with_lora(pretrained_base: Path, text_file: Path) -> None:
    config = tiny_config("tiny_pretrain_cpu.yaml", text_file, *lora(pretrained_base))
    trained, base, stats = learned(config)
    assert trained["perplexity"] < base["perplexity"]
    assert 0 < stats.trainable_parameters < stats.parameters / 5


def test_instruction_sft_with_lora(pretrained_base: Path, instruction_file: Path) -> None:
    trained, base, stats = learned(tiny_config("tiny_sft_cpu.yaml", instruction_file, *lora(pretrained_base)))
    assert trained["completion_perplexity"] < base["completion_perplexity"] / 2
    assert trained["exact_match"] >= base["exact_match"]
    assert stats.trainable_parameters < stats.parameters / 5


def test_chat_sft_with_lora(pretrained_base: Path, chat_file: Path) -> None:
    # four epochs, not CHAT's ten: perplexity falls well before the exact answers the from-scratch test needs come
    config = tiny_config("tiny_sft_cpu.yaml", chat_file, "data.kind=chat", *CHAT, "train.epochs=4",
                         *lora(pretrained_base))
    trained, base, _ = learned(config)
    assert trained["completion_perplexity"] < base["completion_perplexity"] / 2


def test_classification_with_lora(pretrained_base: Path, labelled_file: Path) -> None:
    config = tiny_config("tiny_classify_cpu.yaml", labelled_file, *lora(pretrained_base))
    trained, base, _ = learned(config)
    assert trained["macro_f1"] > base["macro_f1"] and trained["macro_f1"] > 0.8


def test_full_fine_tuning_of_a_pretrained_model(pretrained_base: Path, instruction_file: Path) -> None:
    config = tiny_config("tiny_sft_cpu.yaml", instruction_file, f"model.name_or_path={pretrained_base}",
                         "train.learning_rate=2e-3")
    trained, base, stats = learned(config)
    assert trained["completion_perplexity"] < base["completion_perplexity"] / 2
    assert stats.trainable_parameters == stats.parameters
