"""Masked language modelling: what is masked and labelled, the fixed held-out mask, the errors that name the setting
to change, and (slow) an encoder trained from scratch, registered as fill-mask and asked to fill masks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from llmops.core import metrics
from llmops.core.config import ConfigError, DataConfig, ModelConfig
from llmops.core.workspace import read_jsonl, write_jsonl
from llmops.data.synthetic import text_records
from llmops.data.tokenize import IGNORE_INDEX, Encoder, train_tokenizer
from llmops.flows.cli import app
from llmops.objectives import masked_lm
from llmops.serving.predict import RowError, read_request
from tests.conftest import tiny_config
from tests.unit.helpers import data_stages, run_all_stages

runner = CliRunner()
MLM = "tiny_mlm_cpu.yaml"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mlm") / "corpus.jsonl"
    write_jsonl(path, text_records(400, seed=3))
    return path


@pytest.fixture(scope="module")
def tokenizer(corpus: Path) -> Any:
    return train_tokenizer(corpus, "text", 400, "masked_lm")


def encoded(tokenizer: Any, rows: list[dict[str, str]]) -> list[dict[str, list[int]]]:
    batch = Encoder(tokenizer, DataConfig(kind="text", objective="masked_lm"), 48)(rows)
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
    originals = masked_lm.padded([row["input_ids"] for row in rows], tokenizer.pad_token_id)
    maskable = masked_lm.padded([row["labels"] for row in rows], IGNORE_INDEX) != IGNORE_INDEX
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
    first = masked_lm.eval_batch(tokenizer, rows, 48)
    # another tokenizer trained on the same data, in another object: the same positions
    again = masked_lm.eval_batch(train_tokenizer(corpus, "text", 400, "masked_lm"), list(reversed(rows)), 48)
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

    from llmops.models.modeling import build_model

    model = build_model(ModelConfig(architecture="bert", hidden_size=16, num_layers=1, num_heads=2), tokenizer, 0,
                        "text", objective="masked_lm").eval()
    rows = text_records(12, seed=9)
    parts, filled = masked_lm.score(model, tokenizer, rows, 48, batch_size=5)
    for index, (inputs, labels) in enumerate(masked_lm.eval_batch(tokenizer, rows, 48)):
        with torch.no_grad():  # the row alone, unpadded
            logits = model(input_ids=torch.tensor([inputs])).logits[0]
        hidden = [i for i, label in enumerate(labels) if label != IGNORE_INDEX]
        nll = sum(-logits[i].log_softmax(-1)[labels[i]].item() for i in hidden)
        hits = sum(int(logits[i].argmax().item() == labels[i]) for i in hidden)
        assert parts["masked_accuracy"][index].tolist() == [hits, len(hidden)]
        assert parts["masked_loss"][index] == pytest.approx([nll, len(hidden)], rel=1e-4)
        assert filled[index].count("[") == len(hidden)
    assert metrics.value("masked_perplexity", parts["masked_perplexity"]) == pytest.approx(
        float(np.exp(parts["masked_loss"][:, 0].sum() / parts["masked_loss"][:, 1].sum())))


def test_a_tokenizer_without_a_mask_token_is_one_line_naming_the_setting(corpus: Path, tmp_path: Path) -> None:
    causal = train_tokenizer(corpus, "text", 400)
    causal.save_pretrained(str(tmp_path / "causal-tokenizer"))
    config = tiny_config(MLM, corpus, f"tokenize.tokenizer={tmp_path / 'causal-tokenizer'}")
    with pytest.raises(masked_lm.MaskedLMError) as caught:
        data_stages(config)
    message = str(caught.value)
    assert "\n" not in message and "has no mask token" in message and "tokenize.tokenizer" in message


def test_masked_lm_needs_an_encoder_and_full_fine_tuning(tokenizer: Any, tmp_path: Path) -> None:
    from transformers import GPT2Config

    from llmops.models.modeling import build_model

    def refusal(**settings: Any) -> str:
        with pytest.raises(masked_lm.MaskedLMError) as caught:
            build_model(ModelConfig(**settings), tokenizer, 0, "text", objective="masked_lm")
        assert "\n" not in str(caught.value)
        return str(caught.value)

    assert "set model.architecture to bert or roberta (got llama" in refusal(architecture="llama")
    GPT2Config(n_embd=16, n_layer=1, n_head=2).save_pretrained(str(tmp_path / "decoder"))
    assert "is a gpt2 model without a masked-LM head (decoder-only)" in refusal(name_or_path=str(tmp_path / "decoder"))
    assert "model.adapter=lora is not supported" in refusal(name_or_path=str(tmp_path / "decoder"), adapter="lora")
    model = build_model(ModelConfig(architecture="roberta", hidden_size=16, num_layers=1, num_heads=2), tokenizer, 0,
                        "text", objective="masked_lm")
    assert type(model).__name__ == "RobertaForMaskedLM" and model.config.vocab_size == len(tokenizer)
    batch = tokenizer(["534 is written DXXXIV. " * 12], return_tensors="pt")  # past 48 tokens: positions fit
    assert model(**batch).logits.shape == (1, batch["input_ids"].shape[1], len(tokenizer))


def test_masked_lm_reports_its_own_metrics_and_decides_on_masked_accuracy(corpus: Path) -> None:
    kind = metrics.metric_set("text", "masked_lm")
    assert metrics.BY_KIND[kind] == ("masked_accuracy", "masked_loss", "masked_perplexity")
    assert metrics.choose_primary(kind, None, [])[0] == "masked_accuracy"
    assert tiny_config(MLM, corpus, "evaluate.primary_metric=masked_perplexity").evaluate.primary_metric
    with pytest.raises(ConfigError, match="perplexity is not reported for masked_lm data"):
        tiny_config(MLM, corpus, "evaluate.primary_metric=perplexity")
    # per-example parts: (hits, masked tokens) pool into a token-level accuracy
    assert metrics.value("masked_accuracy", np.array([[1.0, 1.0], [0.0, 3.0]])) == 0.25


def test_a_predict_row_needs_a_mask_and_the_placeholder_becomes_the_models_own() -> None:
    request = read_request(3, b'{"text": "534 is [MASK] DXXXIV."}', classifier=False, mask_token="<|mask|>")
    assert request.task == "fill_mask" and request.text == "534 is <|mask|> DXXXIV."
    assert read_request(1, b'{"text": "534 <mask> written"}', False, mask_token="<mask>").text == "534 <mask> written"
    with pytest.raises(RowError, match=r"no masked position to fill: write <\|mask\|> \(or \[MASK\]\)"):
        read_request(4, b'{"text": "534 is written DXXXIV."}', classifier=False, mask_token="<|mask|>")


@pytest.mark.slow
def test_an_encoder_learns_to_fill_masks_and_its_registered_version_fills_them(text_file: Path,
                                                                               tmp_path: Path) -> None:
    import mlflow
    import yaml

    records = run_all_stages(tiny_config(MLM, text_file), "masked-lm-test")
    figures = records["evaluate"].figures
    trained, untrained = figures.metrics["trained"], figures.metrics["untrained"]
    assert figures.primary_metric == "masked_accuracy" and not records["train"].figures.packed
    print(f"masked LM, {figures.examples} held-out rows: trained {trained}, untrained {untrained}")
    assert trained["masked_accuracy"] > untrained["masked_accuracy"] + 0.2
    assert trained["masked_perplexity"] < untrained["masked_perplexity"] / 10
    registration = records["register"]
    assert registration.alias == "champion"
    local = Path(mlflow.artifacts.download_artifacts(f"models:/llmops-tiny-mlm/{registration.version}",
                                                     dst_path=str(tmp_path / "registered")))
    assert yaml.safe_load((local / "MLmodel").read_text())["flavors"]["transformers"]["task"] == "fill-mask"

    # held-out sentences with " written" hidden, as the placeholder and as the model's own mask token
    held_out = [row["text"] for row in read_jsonl(records["dedup"].dir / "eval.jsonl")][:11]
    rows = [{"text": text.replace(" written", " [MASK]", 1)} for text in held_out[:10]]
    rows += [{"text": held_out[10].replace(" written", "<|mask|>", 1)}, {"text": held_out[10]}]
    result = runner.invoke(app, ["predict", f"llmops-tiny-mlm/{registration.version}", "--input", "-"],
                           input="".join(json.dumps(row) + "\n" for row in rows))
    assert result.exit_code == 1, result.output  # the row without a mask is an error row
    answers = [json.loads(line) for line in result.stdout.splitlines()]
    for answer in answers[:11]:
        fills = answer["masks"][0]["fills"]
        assert len(answer["masks"]) == 1 and len(fills) == masked_lm.TOP_K
        probabilities = [fill["probability"] for fill in fills]
        assert probabilities == sorted(probabilities, reverse=True) and 0 < sum(probabilities) <= 1 + 1e-6
    right = [answer["filled"] == text for answer, text in zip(answers[:11], held_out, strict=True)]
    assert sum(right) >= 9, answers
    tops = [answer["masks"][0]["fills"][0]["token"] for answer in answers[:11]]
    assert all(top == " written" for top, ok in zip(tops, right, strict=True) if ok)
    assert answers[11]["line"] == 12 and "no masked position to fill" in answers[11]["error"]

    # a second training is judged against the champion re-scored from the registry: the same held-out mask gives
    # the champion exactly the figures its own evaluation recorded
    retrained = tiny_config(MLM, text_file, "train.seed=1", "train.max_steps=30")
    second = run_all_stages(retrained, "masked-lm-test")["register"]
    assert second.comparison is not None and second.comparison.champion_version == registration.version
    assert second.comparison.champion == pytest.approx(trained, rel=1e-6)

    exported = runner.invoke(app, ["models", "export", f"llmops-tiny-mlm/{registration.version}",
                                   str(tmp_path / "exported")])
    assert exported.exit_code == 0, exported.output
    assert "pipeline_tag: fill-mask" in (tmp_path / "exported" / "README.md").read_text()
