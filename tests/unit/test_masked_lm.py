"""Masked language modelling: what is masked and labelled, the fixed held-out mask, the errors that name the setting
to change (an encoder trained from scratch and asked to fill masks: tests/integration/test_masked_lm_e2e.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from llmops.config.schema import DataConfig, EvaluateConfig, ModelConfig
from llmops.data.synthetic import text_records
from llmops.data.tokenize import training_texts
from llmops.io.errors import ConfigError
from llmops.io.files import read_jsonl, write_jsonl
from llmops.objectives import masked_lm, metrics, selected
from llmops.objectives.base import Encoding, ObjectiveError, RowError, ScoringContext, Served, padded
from llmops.registry.loading import LoadedVersion
from llmops.serving.predict import read_request
from llmops.text.encoding import IGNORE_INDEX
from tests.conftest import tiny_config
from tests.helpers import data_stages

MLM = "tiny_mlm_cpu.yaml"
OBJECTIVE = selected(DataConfig(kind="text", objective="masked_lm"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mlm") / "corpus.jsonl"
    write_jsonl(path, text_records(400, seed=3))
    return path


@pytest.fixture(scope="module")
def tokenizer(corpus: Path) -> Any:
    return OBJECTIVE.train_tokenizer(training_texts(read_jsonl(corpus), OBJECTIVE), 400)


def encoded(tokenizer: Any, rows: list[dict[str, str]]) -> list[dict[str, list[int]]]:
    batch = OBJECTIVE.encode(tokenizer, rows, Encoding(48))
    return [{"input_ids": ids, "labels": labels} for ids, labels in zip(batch["input_ids"], batch["labels"],
                                                                       strict=True)]


def test_the_trained_tokenizer_frames_texts_and_keeps_the_space_before_a_mask(tokenizer: Any) -> None:
    tokens = tokenizer.convert_ids_to_tokens(tokenizer("4211 is written four thousand")["input_ids"])
    assert tokens[0] == "<|cls|>" and tokens[-1] == "<|end|>"
    masked = tokenizer.convert_ids_to_tokens(tokenizer("4211 is <|mask|> four thousand")["input_ids"])
    # the mask takes the place of the token " written" whole: no stray space token before it
    assert masked == tokens[:tokens.index("Ġwritten")] + ["<|mask|>"] + tokens[tokens.index("Ġwritten") + 1:]


def test_stored_labels_mark_every_token_but_the_special_ones(tokenizer: Any) -> None:
    row = encoded(tokenizer, [{"text": "534 is written DXXXIV."}])[0]
    assert row["labels"][0] == row["labels"][-1] == IGNORE_INDEX
    assert row["labels"][1:-1] == row["input_ids"][1:-1]
    long = encoded(tokenizer, [{"text": " ".join(["534 is written DXXXIV."] * 20)}])[0]
    assert len(long["input_ids"]) == 48 and long["input_ids"][-1] == tokenizer.sep_token_id


def test_training_masks_about_15_percent_and_labels_only_the_masked_positions(tokenizer: Any) -> None:
    rows = encoded(tokenizer, text_records(600, seed=11))
    batch = masked_lm.MaskingCollator(tokenizer, seed=0)(rows)
    inputs, labels = batch["input_ids"], batch["labels"]
    originals = padded([row["input_ids"] for row in rows], tokenizer.pad_token_id)
    maskable = padded([row["labels"] for row in rows], IGNORE_INDEX) != IGNORE_INDEX
    chosen = labels != IGNORE_INDEX
    # labels sit on maskable positions only (never CLS, END or padding) and hold the original token there
    assert not (chosen & ~maskable).any()
    assert (labels[chosen] == originals[chosen]).all()
    # every position whose input changed carries a label
    assert not ((inputs != originals) & ~chosen).any()
    share = chosen.sum().item() / maskable.sum().item()
    assert 0.13 < share < 0.17
    replaced = (inputs[chosen] == tokenizer.mask_token_id).float().mean().item()
    assert 0.75 < replaced < 0.85  # 80% become the mask token; the rest a random token or themselves


def test_the_held_out_mask_is_the_same_every_time_and_only_its_positions_are_scored(corpus: Path,
                                                                                     tokenizer: Any) -> None:
    rows = text_records(50, seed=5)
    first = OBJECTIVE.eval_batch(tokenizer, rows, Encoding(48))
    # another tokenizer trained on the same data, in another object: the same positions
    again = OBJECTIVE.eval_batch(OBJECTIVE.train_tokenizer(training_texts(read_jsonl(corpus), OBJECTIVE), 400),
                                 list(reversed(rows)), Encoding(48))
    assert first == list(reversed(again))
    for row, (inputs, labels) in zip(encoded(tokenizer, rows), first, strict=True):
        positions = [i for i, label in enumerate(labels) if label != IGNORE_INDEX]
        maskable = sum(label != IGNORE_INDEX for label in row["labels"])
        assert len(positions) == max(1, round(0.15 * maskable))
        assert all(inputs[i] == tokenizer.mask_token_id and labels[i] == row["input_ids"][i] for i in positions)
        assert all(inputs[i] == row["input_ids"][i] for i in range(len(inputs)) if i not in positions)
    # a different text draws its own positions
    assert masked_lm.eval_positions("a", list(range(40))) != masked_lm.eval_positions("b", list(range(40)))


def test_scores_count_the_hidden_tokens_of_each_row_alone_whatever_the_batch(tokenizer: Any) -> None:
    import torch

    model = OBJECTIVE.build_model(ModelConfig(architecture="bert", hidden_size=16, num_layers=1, num_heads=2),
                                  tokenizer, 0, []).eval()
    rows = text_records(12, seed=9)
    scored = OBJECTIVE.score(model, tokenizer, rows, ScoringContext(EvaluateConfig(batch_size=5), Encoding(48)))
    parts, filled = scored.parts, scored.outputs
    for index, (inputs, labels) in enumerate(OBJECTIVE.eval_batch(tokenizer, rows, Encoding(48))):
        with torch.no_grad():  # the row alone, unpadded
            logits = model(input_ids=torch.tensor([inputs])).logits[0]
        hidden = [i for i, label in enumerate(labels) if label != IGNORE_INDEX]
        nll = sum(-logits[i].log_softmax(-1)[labels[i]].item() for i in hidden)
        hits = sum(int(logits[i].argmax().item() == labels[i]) for i in hidden)
        assert parts["masked_accuracy"][index].tolist() == [hits, len(hidden)]
        assert parts["masked_loss"][index] == pytest.approx([nll, len(hidden)], rel=1e-4)
        assert filled[index].count("[") == len(hidden)
    assert metrics.value(OBJECTIVE.metrics["masked_perplexity"], parts["masked_perplexity"]) == pytest.approx(
        float(np.exp(parts["masked_loss"][:, 0].sum() / parts["masked_loss"][:, 1].sum())))


def test_a_tokenizer_without_a_mask_token_is_one_line_naming_the_setting(corpus: Path, tmp_path: Path) -> None:
    causal_lm = selected(DataConfig(kind="text"))
    causal = causal_lm.train_tokenizer(training_texts(read_jsonl(corpus), causal_lm), 400)
    causal.save_pretrained(str(tmp_path / "causal-tokenizer"))
    config = tiny_config(MLM, corpus, f"tokenize.tokenizer={tmp_path / 'causal-tokenizer'}")
    with pytest.raises(ObjectiveError) as caught:
        data_stages(config)
    message = str(caught.value)
    assert "\n" not in message and "has no mask token" in message and "tokenize.tokenizer" in message


def test_masked_lm_needs_an_encoder_and_full_fine_tuning(corpus: Path, tokenizer: Any, tmp_path: Path) -> None:
    from transformers import GPT2Config

    def refusal(*overrides: str) -> str:
        """A config the objective refuses when it is loaded: one line naming the setting."""
        with pytest.raises(ConfigError) as caught:
            tiny_config(MLM, corpus, *overrides)
        assert "\n" not in str(caught.value)
        return str(caught.value)

    def build_refusal(**settings: Any) -> str:
        """A pretrained base the objective refuses when it builds the model."""
        with pytest.raises(ObjectiveError) as caught:
            OBJECTIVE.build_model(ModelConfig(**settings), tokenizer, 0, [])
        assert "\n" not in str(caught.value)
        return str(caught.value)

    assert "model.architecture: masked_lm builds bert or roberta from scratch (got llama)" in refusal(
        "model.architecture=llama")
    GPT2Config(n_embd=16, n_layer=1, n_head=2).save_pretrained(str(tmp_path / "decoder"))
    assert "is a gpt2 model without a masked-LM head (decoder-only)" in build_refusal(
        name_or_path=str(tmp_path / "decoder"))
    assert "model.adapter=lora is not supported" in refusal(f"model.name_or_path={tmp_path / 'decoder'}",
                                                            "model.adapter=lora")
    model = OBJECTIVE.build_model(ModelConfig(architecture="roberta", hidden_size=16, num_layers=1, num_heads=2),
                                  tokenizer, 0, [])
    assert type(model).__name__ == "RobertaForMaskedLM" and model.config.vocab_size == len(tokenizer)
    batch = tokenizer(["534 is written DXXXIV. " * 12], return_tensors="pt")  # past 48 tokens: positions fit
    assert model(**batch).logits.shape == (1, batch["input_ids"].shape[1], len(tokenizer))


def test_masked_lm_reports_its_own_metrics_and_decides_on_masked_accuracy(corpus: Path) -> None:
    assert tuple(OBJECTIVE.metrics) == ("masked_accuracy", "masked_loss", "masked_perplexity")
    assert OBJECTIVE.primary(None, [])[0] == "masked_accuracy"
    assert tiny_config(MLM, corpus, "evaluate.primary_metric=masked_perplexity").evaluate.primary_metric
    with pytest.raises(ConfigError, match="perplexity is not reported by masked_lm"):
        tiny_config(MLM, corpus, "evaluate.primary_metric=perplexity")
    # per-example parts: (hits, masked tokens) pool into a token-level accuracy
    assert metrics.value(OBJECTIVE.metrics["masked_accuracy"], np.array([[1.0, 1.0], [0.0, 3.0]])) == 0.25


def served_with_mask(mask_token: str) -> LoadedVersion:
    """A masked LM as predict holds it; reading a row needs only its tokenizer's mask token."""
    served = Served(model=None, tokenizer=SimpleNamespace(mask_token=mask_token), labels=None,
                    encoding=Encoding(48), max_new_tokens=32)
    return LoadedVersion(name="mlm", version="1", objective=OBJECTIVE, task=OBJECTIVE.task, served=served)


def test_a_predict_row_needs_a_mask_and_the_placeholder_becomes_the_models_own() -> None:
    request = read_request(served_with_mask("<|mask|>"), 3, b'{"text": "534 is [MASK] DXXXIV."}')
    assert request.ask == "fill_mask" and request.fields["text"] == "534 is <|mask|> DXXXIV."
    assert request.line == 3
    assert read_request(served_with_mask("<mask>"), 1,
                        b'{"text": "534 <mask> written"}').fields["text"] == "534 <mask> written"
    with pytest.raises(RowError, match=r"no masked position to fill: write <\|mask\|> \(or \[MASK\]\)"):
        read_request(served_with_mask("<|mask|>"), 4, b'{"text": "534 is written DXXXIV."}')
