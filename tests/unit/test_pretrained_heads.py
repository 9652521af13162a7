"""A pretrained base whose head classifies another number of labels than the data gives (a 5-way classifier tuned
to 3 labels, a classifier made a reward model) keeps its body and gets a new head, and the log says so."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from transformers import BertConfig, BertForSequenceClassification

from llmops.config.schema import DataConfig, ModelConfig
from llmops.objectives import selected
from llmops.text.tokenizers import train_encoder_bpe

LABELS = ["date", "words", "roman"]


@pytest.fixture(scope="module")
def five_way(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """A small BERT classifier over five labels, saved as a hub checkpoint is, with its tokenizer."""
    folder = tmp_path_factory.mktemp("five-way")
    tokenizer = train_encoder_bpe([f"row {n} of the {n % 7}th kind" for n in range(300)], 200)
    tokenizer.save_pretrained(folder)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id,
                        id2label={i: f"class{i}" for i in range(5)}, label2id={f"class{i}": i for i in range(5)})
    BertForSequenceClassification(config).save_pretrained(folder)
    return folder, tokenizer


@pytest.mark.parametrize(("objective", "labels", "outputs"), [("classification", LABELS, 3), ("reward", [], 1)])
def test_a_head_of_another_size_is_replaced_and_the_body_kept(five_way: tuple[Path, object], objective: str,
                                                               labels: list[str], outputs: int,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    import torch
    from safetensors.torch import load_file

    folder, tokenizer = five_way
    kind = {"classification": "classification", "reward": "preference"}[objective]
    chosen = selected(DataConfig(kind=kind, objective=objective, labels=labels))
    with caplog.at_level(logging.WARNING, logger="llmops"):
        model = chosen.build_model(ModelConfig(name_or_path=str(folder)), tokenizer, 0, labels)
    assert model.config.num_labels == outputs and model.classifier.weight.shape[0] == outputs
    saved = load_file(str(folder / "model.safetensors"))
    body = dict(model.named_parameters())
    assert torch.equal(body["bert.embeddings.word_embeddings.weight"], saved["bert.embeddings.word_embeddings.weight"])
    assert [r.getMessage() for r in caplog.records if "a new head is trained" in r.getMessage()] == [
        f"model {folder}: its head has 5 labels (class0, class1, class2, class3, class4) and this training "
        f"{outputs}: a new head is trained from scratch"]


def test_a_head_that_fits_is_kept_as_it_is(five_way: tuple[Path, object], caplog: pytest.LogCaptureFixture) -> None:
    import torch
    from safetensors.torch import load_file

    folder, tokenizer = five_way
    labels = [f"class{i}" for i in range(5)]
    chosen = selected(DataConfig(kind="classification", labels=labels))
    with caplog.at_level(logging.WARNING, logger="llmops"):
        model = chosen.build_model(ModelConfig(name_or_path=str(folder)), tokenizer, 0, labels)
    assert torch.equal(model.classifier.weight, load_file(str(folder / "model.safetensors"))["classifier.weight"])
    assert not [r for r in caplog.records if "a new head" in r.getMessage()]
