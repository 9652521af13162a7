"""`llmops predict` end to end (slow): registered versions of each objective answer through the CLI as their
evaluation says."""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from llmops.cli.app import app
from llmops.data.synthetic import chat_records, classification_records, instruction_records, text_records
from llmops.io.files import read_jsonl, write_jsonl
from llmops.io.tables import table_rows
from tests.conftest import tiny_config
from tests.helpers import run_all_stages, workspace_at

runner = CliRunner()
LORA = ("model.adapter=lora", "model.lora.r=8", "train.learning_rate=1e-2")


def trained_in(registry: Path, data: Path, rows: list[dict[str, Any]], config: str, *overrides: str) -> dict:
    write_jsonl(data, rows)
    with workspace_at(registry):
        return run_all_stages(tiny_config(config, data, *overrides), "predict-test")


@pytest.fixture(scope="module")
def sft(registry: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    data = tmp_path_factory.mktemp("sft") / "instructions.jsonl"
    return trained_in(registry, data, instruction_records(1500, seed=7), "tiny_sft_cpu.yaml")


@pytest.fixture(scope="module")
def chat_lora(registry: Path, pretrained_base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    data = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    return trained_in(registry, data, chat_records(300, seed=3), "tiny_sft_cpu.yaml", "data.kind=chat",
                      "tokenize.max_length=64", "train.epochs=2", "evaluate.max_new_tokens=24",
                      "register.model_name=llmops-tiny-chat", f"model.name_or_path={pretrained_base}", *LORA)


@pytest.fixture(scope="module")
def classifier_lora(registry: Path, pretrained_base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    data = tmp_path_factory.mktemp("labels") / "labels.jsonl"
    return trained_in(registry, data, classification_records(300, seed=3), "tiny_classify_cpu.yaml",
                      f"model.name_or_path={pretrained_base}", "train.epochs=2", *LORA)


@pytest.fixture(scope="module")
def text_model(registry: Path, pretrained_base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    data = tmp_path_factory.mktemp("text") / "corpus.jsonl"
    return trained_in(registry, data, text_records(800, seed=11), "tiny_pretrain_cpu.yaml",
                      f"model.name_or_path={pretrained_base}", "train.max_steps=10", "train.learning_rate=1e-3")


def predict(*args: str, stdin: str | bytes | None = None) -> Any:
    return runner.invoke(app, ["predict", *args], input=stdin)


def evaluated(records: dict[str, Any]) -> dict[str, float]:
    """The registered version's held-out metrics, as its evaluation computed them."""
    return records["evaluate"].figures.metrics["trained"]


def held_out(records: dict[str, Any]) -> list[dict[str, Any]]:
    return list(table_rows(records["dedup"].dir / "eval"))


@pytest.mark.slow
def test_instruction_model_answers_held_out_questions_as_its_evaluation_did(sft: dict, in_registry: Path,
                                                                            tmp_path: Path) -> None:
    samples = list(read_jsonl(sft["evaluate"].dir / "samples.jsonl"))
    rows = held_out(sft)[:len(samples)]
    write_jsonl(tmp_path / "questions.jsonl", [{"instruction": r["instruction"], "input": r["input"],
                                                "output": r["output"]} for r in rows])
    name = sft["register"].model_name
    result = predict(f"{name}@champion", "--input", str(tmp_path / "questions.jsonl"), "--output",
                     str(tmp_path / "answers.jsonl"), "--batch-size", str(len(rows)))
    assert result.exit_code == 0, result.output
    assert result.stdout == ""  # results went to --output; the progress bar and header to stderr
    # the lengths of the version's own run: its evaluation's max_new_tokens, its tokenizer's max_length
    assert re.search(rf"{name}/1 \({name}@champion\) on \S+: replies of up to 20 tokens, texts cut at 48 tokens",
                     result.stderr), result.stderr
    answers = list(read_jsonl(tmp_path / "answers.jsonl"))
    assert [a["line"] for a in answers] == list(range(1, len(rows) + 1))
    # the same greedy replies the evaluation recorded, question by question
    assert [a["output"] for a in answers] == [s["trained_output"] for s in samples]
    assert [a["reference"] for a in answers] == [r["output"] for r in rows]
    right = [a for a in answers if a["output"] == a["reference"]]
    assert len(right) / len(answers) == pytest.approx(evaluated(sft)["exact_match"])
    assert right, "the tiny SFT model answers some held-out questions exactly"


@pytest.mark.slow
def test_chat_lora_version_replies_to_conversations(chat_lora: dict, in_registry: Path, tmp_path: Path) -> None:
    samples = list(read_jsonl(chat_lora["evaluate"].dir / "samples.jsonl"))
    rows = held_out(chat_lora)[:len(samples)]
    # ShareGPT turns are read as the pipeline reads them
    sharegpt = [{"conversations": [{"from": {"user": "human", "assistant": "gpt"}.get(t["role"], t["role"]),
                                    "value": t["content"]} for t in row["messages"]]} for row in rows]
    write_jsonl(tmp_path / "chats.jsonl", sharegpt)
    result = predict("llmops-tiny-chat/1", "-i", str(tmp_path / "chats.jsonl"), "-b", str(len(rows)))
    assert result.exit_code == 0, result.output
    answers = [json.loads(line) for line in result.stdout.splitlines()]
    assert [a["output"] for a in answers] == [s["trained_output"] for s in samples]
    assert [a["reference"] for a in answers] == [row["messages"][-1]["content"] for row in rows]


@pytest.mark.slow
def test_lora_classifier_gives_declared_labels_with_probabilities(classifier_lora: dict, in_registry: Path,
                                                                  tmp_path: Path) -> None:
    rows = held_out(classifier_lora)
    write_jsonl(tmp_path / "texts.jsonl", [{"text": row["text"]} for row in rows])
    result = predict("llmops-tiny-classify", "-i", str(tmp_path / "texts.jsonl"))
    assert result.exit_code == 0, result.output
    answers = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(answers) == len(rows)
    declared = ["date", "words", "roman"]
    for answer in answers:
        assert list(answer["scores"]) == declared and answer["label"] in declared
        assert sum(answer["scores"].values()) == pytest.approx(1.0, abs=1e-5)
        assert answer["label"] == max(answer["scores"], key=answer["scores"].get)
    accuracy = sum(a["label"] == r["label"] for a, r in zip(answers, rows, strict=True)) / len(rows)
    assert accuracy == pytest.approx(evaluated(classifier_lora)["accuracy"])
    assert accuracy > 0.8


@pytest.mark.slow
def test_text_model_perplexity_is_its_evaluation_and_lower_in_distribution(text_model: dict,
                                                                           in_registry: Path) -> None:
    rows = held_out(text_model)
    rng = random.Random(0)
    shuffled = []
    for row in rows:
        words = row["text"].split()
        rng.shuffle(words)
        shuffled.append({"text": " ".join(words)})
    stdin = "".join(json.dumps(row) + "\n" for row in [{"text": r["text"]} for r in rows] + shuffled)
    # by version: ten steps on a base pretrained on such text need not beat it, so there may be no champion
    result = predict(f"llmops-tiny-pretrain/{text_model['register'].version}", "--input", "-", stdin=stdin)
    assert result.exit_code == 0, result.output
    answers = [json.loads(line) for line in result.stdout.splitlines()]
    real, mixed = answers[:len(rows)], answers[len(rows):]
    assert all(math.isfinite(a["perplexity"]) and a["perplexity"] > 1 and a["tokens"] > 0 for a in answers)
    # the per-row perplexities pool back into the registered corpus perplexity
    pooled = math.exp(sum(math.log(a["perplexity"]) * a["tokens"] for a in real) / sum(a["tokens"] for a in real))
    assert pooled == pytest.approx(evaluated(text_model)["perplexity"], rel=1e-3)
    mean = sum(a["perplexity"] for a in real) / len(real)
    assert mean < sum(a["perplexity"] for a in mixed) / len(mixed) / 2


@pytest.mark.slow
def test_text_model_continues_prompts_through_mlflow_pyfunc_without_repeating_them(text_model: dict,
                                                                                  in_registry: Path) -> None:
    import mlflow

    from llmops.config.schema import TrackingConfig
    from llmops.registry.loading import load_version
    from llmops.registry.references import parse_reference

    version = f"llmops-tiny-pretrain/{text_model['register'].version}"
    prompts = [" ".join(row["text"].split()[:3]) for row in held_out(text_model)[:4]]
    served = load_version(parse_reference(version), TrackingConfig()).served  # and points MLflow at the registry
    continued = mlflow.pyfunc.load_model(f"models:/{version}").predict(prompts)
    tokenizer = served.tokenizer
    # the greedy continuation of the run's evaluate.max_new_tokens, and not the prompt again
    for prompt, text in zip(prompts, continued, strict=True):
        ids = tokenizer(prompt, return_tensors="pt").to(served.model.device)
        greedy = served.model.generate(**ids, max_new_tokens=served.max_new_tokens, do_sample=False,
                                       pad_token_id=tokenizer.pad_token_id)
        assert text.strip() == tokenizer.decode(greedy[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()
        assert not text.strip().startswith(prompt)
