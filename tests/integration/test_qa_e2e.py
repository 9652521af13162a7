"""Extractive QA end to end on CPU: from scratch, and from a pretrained encoder folder (a BERT pretrained here as a
masked LM); each clearly beats its untrained head on held-out token F1, registers as question-answering, and
answers `llmops predict` rows with a span, its offsets and a score."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from llmops.data.synthetic import qa_records
from llmops.io.files import write_jsonl
from llmops.objectives import load_config
from llmops.serving import predict
from tests.helpers import data_stages, run_all_stages, stage
from tests.sources import REPO

pytestmark = pytest.mark.slow


def qa_config(path: Path, *overrides: str) -> object:
    return load_config(REPO / "configs" / "tiny_qa_cpu.yaml", [f"data.path={path}", *overrides])


def test_qa_from_scratch_finds_the_answers_and_is_served_by_predict(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "qa.jsonl", qa_records(2000, seed=21))
    config = qa_config(tmp_path / "qa.jsonl", "register.model_name=tiny-qa")
    records = run_all_stages(config, "qa")
    figures = records["evaluate"].figures
    trained, untrained = figures.metrics["trained"], figures.metrics["untrained"]
    print(f"\nQA from scratch, {figures.examples} held-out questions: f1 {untrained['f1']:.3f} -> {trained['f1']:.3f}, "
          f"exact match {untrained['exact_match']:.3f} -> {trained['exact_match']:.3f}")
    assert figures.primary_metric == "f1"
    assert trained["f1"] > untrained["f1"] + 0.4 and figures.gain_over_baseline["f1"]["low"] > 0.3
    assert records["tokenize"].figures.train.rows > records["dedup"].figures.train_rows  # long contexts: windows
    assert records["register"].alias == "champion"
    loaded = predict.load("tiny-qa", config.tracking)
    assert loaded.task == "question-answering"
    context = "The harbour opened on 3 May 1990. The harbour closed on 7 June 2001."
    rows = [json.dumps({"context": context, "question": "When did the harbour close?", "answer": "7 June 2001"}),
            json.dumps({"context": context}), "not json"]
    answers = list(predict.predict_lines(loaded, [row.encode() for row in rows], batch_size=8))
    assert answers[0]["answer"] == context[answers[0]["start"]:answers[0]["end"]]
    assert answers[0]["reference"] == "7 June 2001" and 0 < answers[0]["score"] <= 1
    assert answers[1]["error"].startswith("question: missing") and "error" in answers[2]


def test_qa_from_a_pretrained_encoder_folder(tmp_path: Path) -> None:
    rows = qa_records(1500, seed=22)
    # the encoder learns the language of questions and contexts first, as a masked LM
    write_jsonl(tmp_path / "texts.jsonl", [{"text": f"{row['question']} {row['context']}"} for row in rows])
    pretrain = load_config(REPO / "configs" / "tiny_mlm_cpu.yaml", [
        f"data.path={tmp_path / 'texts.jsonl'}", "train.epochs=2", "tokenize.vocab_size=512",
        "tokenize.max_length=96"])
    _, tokenized = data_stages(pretrain)
    encoder = tmp_path / "encoder"
    shutil.copytree(stage("train", pretrain, tokenized).dir / "model", encoder)
    write_jsonl(tmp_path / "qa.jsonl", rows)
    config = qa_config(tmp_path / "qa.jsonl", f"model.name_or_path={encoder}", "train.learning_rate=2e-3",
                       "register.model_name=tiny-qa-tuned")
    records = run_all_stages(config, "qa tuned")
    figures = records["evaluate"].figures
    trained, base = figures.metrics["trained"], figures.metrics["base"]
    print(f"\nQA from a pretrained encoder: f1 {base['f1']:.3f} -> {trained['f1']:.3f}")
    assert figures.baseline == "base" and records["tokenize"].figures.tokenizer_source == str(encoder)
    assert trained["f1"] > base["f1"] + 0.3 and records["register"].alias == "champion"
