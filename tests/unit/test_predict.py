"""`llmops predict`: registered versions of each objective answer through the CLI as their evaluation says."""

from __future__ import annotations

import json
import math
import os
import random
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from llmops.core import tracking
from llmops.core.config import TrackingConfig
from llmops.core.workspace import read_jsonl, write_jsonl
from llmops.data.synthetic import chat_records, classification_records, instruction_records, text_records
from llmops.flows.cli import app
from tests.conftest import tiny_config
from tests.unit.helpers import run_all_stages

runner = CliRunner()
LORA = ("model.adapter=lora", "model.lora.r=8", "train.learning_rate=1e-2")


@contextmanager
def workspace_at(folder: Path) -> Iterator[None]:
    """LLMOPS_HOME for work that outlives one test (module fixtures); the test's own is put back after."""
    previous = os.environ.get("LLMOPS_HOME")
    os.environ["LLMOPS_HOME"] = str(folder)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("LLMOPS_HOME", None)
        else:
            os.environ["LLMOPS_HOME"] = previous


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One workspace (and MLflow registry) for the module's registered models."""
    return tmp_path_factory.mktemp("predict") / "home"


@pytest.fixture
def in_registry(registry: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LLMOPS_HOME", str(registry))
    return registry


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
    return list(read_jsonl(records["dedup"].dir / "eval.jsonl"))


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


@pytest.fixture(scope="module")
def random_version(registry: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random causal LM with the scratch chat template, registered as demo/1 @champion: nothing trained,
    no run config (predict falls back to the default lengths)."""
    import mlflow
    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM, LlamaConfig

    from llmops.data.tokenize import prepare_tokenizer, train_tokenizer

    corpus = tmp_path_factory.mktemp("random") / "corpus.jsonl"
    write_jsonl(corpus, [{"text": f"row {i} says hello"} for i in range(50)])
    tokenizer = train_tokenizer(corpus, "text", 300)
    prepare_tokenizer(tokenizer, None, trained_here=True)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))
    with workspace_at(registry):
        config = TrackingConfig()
        with mlflow.start_run(experiment_id=tracking.experiment_id(config)):
            info = mlflow.transformers.log_model({"model": model, "tokenizer": tokenizer}, name="model",
                                                 task="text-generation", pip_requirements=["transformers"],
                                                 model_card=ModelCard("# demo\n"))
        mlflow.register_model(info.model_uri, "demo")
        tracking.client(config).set_registered_model_alias("demo", "champion", "1")
    return "demo"


@pytest.mark.parametrize(("reference", "message"), [
    ("nope", "error: no registered model 'nope' in sqlite:///"),
    ("demo@prod", "error: demo has no alias 'prod' (aliases: @champion (version 1))"),
    ("demo/7", "error: demo has no version 7 (versions: 1)"),
])
def test_unknown_model_alias_or_version_is_one_line_and_exit_2(random_version: str, in_registry: Path,
                                                               reference: str, message: str) -> None:
    result = predict(reference, stdin='{"text": "row 1 says hello"}\n')
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), result.stderr


def test_bad_lines_become_error_rows_with_their_line_numbers(random_version: str, in_registry: Path,
                                                             tmp_path: Path) -> None:
    lines = [b'{"instruction": "Say hello.", "input": "row 1"}', b'{"instruction": "broken"', b"", b"[1, 2]",
             b'{"instruction": 5}', b'{"messages": [{"role": "assistant", "content": "hi"}]}',
             b'{"text": "row 3 says hello"}', b'{"text": "caf\xe9"}', b'{"prompt": "hello"}',
             b'{"messages": [{"role": "user", "content": "row 2"}, {"role": "assistant", "content": "hello"}]}']
    (tmp_path / "rows.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    result = predict("demo", "--input", str(tmp_path / "rows.jsonl"), "--output", str(tmp_path / "out.jsonl"))
    assert result.exit_code == 1, result.output
    out = list(read_jsonl(tmp_path / "out.jsonl"))
    assert [row["line"] for row in out] == [1, 2, 4, 5, 6, 7, 8, 9, 10]  # every row but the blank line
    errors = {row["line"]: row["error"] for row in out if "error" in row}
    assert set(errors) == {2, 4, 5, 6, 8, 9}
    assert errors[2].startswith("json_broken: not valid JSON")
    assert errors[4] == "not_object: a JSON array where an object is expected"
    assert errors[5] == "instruction: expected a string, got int" and errors[8] == "invalid UTF-8 at byte 13"
    assert "must end with a user turn" in errors[6] and errors[9].startswith("expected a field instruction")
    by_line = {row["line"]: row for row in out}
    assert isinstance(by_line[1]["output"], str) and "reference" not in by_line[1]
    assert by_line[10]["reference"] == "hello"
    assert math.isfinite(by_line[7]["perplexity"]) and by_line[7]["tokens"] > 1
    assert "line 2: json_broken: not valid JSON" in result.stderr
    assert "6 rows could not be predicted (line 2, 4, 5, 6, 8, 9)" in result.stderr
