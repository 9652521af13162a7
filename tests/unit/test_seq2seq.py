"""Sequence-to-sequence: column mapping, quarantine, target labels, and a T5 trained, registered and predicted with."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from llmops.core.config import LoraConfig, ModelConfig, PipelineConfig
from llmops.core.workspace import read_jsonl, write_jsonl
from llmops.data.ingest import ingest
from llmops.data.synthetic import words_task
from llmops.data.tokenize import IGNORE_INDEX, Encoder, prepare_tokenizer, train_tokenizer
from llmops.data.validate import validate
from llmops.flows.cli import app
from llmops.models import modeling
from llmops.objectives import seq2seq
from llmops.serving.predict import RowError, read_request
from tests.conftest import tiny_config
from tests.unit.helpers import run_all_stages

CONFIG = "tiny_seq2seq_cpu.yaml"
TINY_T5 = ModelConfig(architecture="t5", hidden_size=16, num_layers=1, num_heads=2)


def lines_file(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    corpus = write_pairs(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", 200)
    trained = train_tokenizer(corpus, "seq2seq", 320)
    prepare_tokenizer(trained, None, trained_here=True)
    return trained


def write_pairs(path: Path, rows: int) -> Path:
    write_jsonl(path, seq2seq.pair_records(words_task, rows, seed=7))
    return path


def test_common_column_names_map_to_source_and_target(tmp_path: Path) -> None:
    data = lines_file(tmp_path / "mixed.jsonl", [
        {"source": "4211", "target": "four thousand two hundred eleven", "text": "not the source"},
        {"document": "a long report", "summary": "short", "id": 3},
        {"article": "the news", "highlights": "the gist"},
        {"question": "2 + 2?", "answer": "4"},
        {"input": "12", "output": "twelve"},
        {"text": "7", "answer": "seven"},
    ])
    ingested = ingest(tiny_config(CONFIG, data), tmp_path)
    records = [{k: v for k, v in row.items() if not k.startswith("_")}
               for row in read_jsonl(ingested.dir / "records.jsonl")]
    assert records == [
        {"source": "4211", "target": "four thousand two hundred eleven"},  # `source` wins over `text`
        {"source": "a long report", "target": "short"},
        {"source": "the news", "target": "the gist"},
        {"source": "2 + 2?", "target": "4"},
        {"source": "12", "target": "twelve"},
        {"source": "7", "target": "seven"},
    ]


def test_configured_columns_win_over_common_names(tmp_path: Path) -> None:
    data = lines_file(tmp_path / "pairs.jsonl", [{"en": "one", "de": "eins", "source": "ignored"}])
    config = PipelineConfig.model_validate({**tiny_config(CONFIG, data).as_dict(), "data": {
        "kind": "seq2seq", "path": str(data), "columns": {"source": "en", "target": "de"}}})
    row = next(iter(read_jsonl(ingest(config, tmp_path).dir / "records.jsonl")))
    assert (row["source"], row["target"], row["_line"]) == ("one", "eins", 1)


def test_unfit_pairs_are_quarantined_with_file_line_code_and_field(tmp_path: Path) -> None:
    data = lines_file(tmp_path / "bad.jsonl", [
        {"source": "1", "target": "one"},                  # 1 kept
        {"source": "2"},                                   # 2 no target
        {"source": 3, "target": "three"},                  # 3 a number
        {"source": "4", "target": "   "},                  # 4 blank
        {"source": "5\u0000", "target": "five"},           # 5 NUL
        {"source": "6", "target": "six\u0007"},            # 6 bell
        {"source": "7" * 80, "target": "seven"},           # 7 over validate.max_chars
        {"article": "8", "summary": None},                 # 8 a null target
        {"source": "9", "target": "nine"},                 # 9 kept
    ])
    config = tiny_config(CONFIG, data, "validate.max_chars=50")
    validated = validate(config, ingest(config, tmp_path))
    found = {(row["source"], row["line"], row["code"], row["field"])
             for row in read_jsonl(validated.dir / "quarantine.jsonl")}
    assert found == {("bad.jsonl", 2, "missing_field", "target"), ("bad.jsonl", 3, "wrong_type", "source"),
                     ("bad.jsonl", 4, "empty", "target"), ("bad.jsonl", 5, "nul_byte", "source"),
                     ("bad.jsonl", 6, "control_char", "target"), ("bad.jsonl", 7, "too_long", "source"),
                     ("bad.jsonl", 8, "missing_field", "target")}
    messages = {row["line"]: row["message"] for row in read_jsonl(validated.dir / "quarantine.jsonl")}
    assert messages[3] == "source: a number where text is expected"
    assert messages[7] == "source: 80 characters, over validate.max_chars (50)"
    assert [row["_line"] for row in read_jsonl(validated.dir / "valid.jsonl")] == [1, 9]


def test_labels_are_the_target_ids_and_padding_is_ignored(tokenizer: Any) -> None:
    from llmops.training.train import collator_for

    rows = [{"source": "4211", "target": "four thousand two hundred eleven"}, {"source": "7", "target": "seven"}]
    config = tiny_config(CONFIG, Path("unused.jsonl"))
    encoded = Encoder(tokenizer, config.data, 32)(rows)
    eos = tokenizer.eos_token_id
    for row, ids, labels in zip(rows, encoded["input_ids"], encoded["labels"], strict=True):
        assert ids == tokenizer(row["source"])["input_ids"] + [eos]
        assert labels == tokenizer(row["target"])["input_ids"] + [eos]
        assert tokenizer.decode(labels, skip_special_tokens=True) == row["target"]
    model = modeling.build_model(TINY_T5, tokenizer, 0, "seq2seq")
    collate = collator_for("seq2seq", tokenizer, model, False, 32)
    batch = collate([{"input_ids": i, "labels": t} for i, t in zip(encoded["input_ids"], encoded["labels"],
                                                                   strict=True)])
    long, short = encoded["labels"]
    assert batch["labels"][0].tolist() == long
    assert batch["labels"][1].tolist() == short + [IGNORE_INDEX] * (len(long) - len(short))
    assert batch["input_ids"][1].tolist()[2:] == [tokenizer.pad_token_id] * 3
    assert batch["attention_mask"][1].tolist() == [1, 1, 0, 0, 0]
    # the decoder reads the target one step behind, from the pad id T5 starts with
    assert batch["decoder_input_ids"][0].tolist() == [tokenizer.pad_token_id] + long[:-1]
    assert model.config.decoder_start_token_id == tokenizer.pad_token_id and model.config.eos_token_id == eos


def test_a_long_pair_is_cut_on_both_sides_and_counted_truncated(tokenizer: Any) -> None:
    encoded = seq2seq.encode(tokenizer, [{"source": "1234567890" * 2, "target": "one two"}], 8)
    assert len(encoded["input_ids"][0]) == 8 and encoded["raw_length"] == [21]
    assert encoded["labels"][0][-1] == tokenizer.eos_token_id  # the target was short enough to keep its end


def test_seq2seq_from_scratch_needs_t5_and_names_the_setting(tokenizer: Any) -> None:
    with pytest.raises(seq2seq.ArchitectureError, match="set model.architecture=t5 \\(got llama\\)"):
        modeling.build_model(ModelConfig(architecture="llama"), tokenizer, 0, "seq2seq")


def test_lora_adapter_on_a_seq2seq_base_saves_and_loads_back(tokenizer: Any, tmp_path: Path) -> None:
    import torch

    base = modeling.build_model(TINY_T5, tokenizer, 0, "seq2seq")
    base.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    adapted_config = ModelConfig(name_or_path=str(tmp_path / "base"), adapter="lora", lora=LoraConfig(r=4))
    model = modeling.with_adapter(modeling.build_model(adapted_config, tokenizer, 0, "seq2seq"), adapted_config,
                                  "seq2seq", False)
    assert type(model).__name__ == "PeftModelForSeq2SeqLM"
    assert 0 < modeling.parameter_counts(model)["trainable_parameters"] < modeling.parameter_counts(base)["parameters"]
    model.save_pretrained(tmp_path / "adapter")
    loaded = modeling.load_trained(tmp_path / "adapter", "seq2seq")
    ids = torch.tensor([tokenizer("42")["input_ids"] + [tokenizer.eos_token_id]])
    assert torch.equal(loaded.generate(input_ids=ids, max_new_tokens=4), model.generate(input_ids=ids,
                                                                                         max_new_tokens=4))


@pytest.mark.parametrize(("row", "source", "reference"), [
    ({"source": "4211", "target": "four thousand two hundred eleven"}, "4211", "four thousand two hundred eleven"),
    ({"input": "12"}, "12", None),
    ({"text": "7", "answer": "seven"}, "7", "seven"),
    ({"document": "a report", "summary": "short"}, "a report", "short"),
])
def test_predict_rows_name_their_source_as_ingest_does(row: dict, source: str, reference: str | None) -> None:
    request = read_request(3, json.dumps(row).encode(), classifier=False, transduces=True)
    assert (request.task, request.text, request.reference, request.line) == ("seq2seq", source, reference, 3)


def test_predict_row_without_a_source_says_which_fields_it_reads() -> None:
    with pytest.raises(RowError, match="expected a source field \\(source, input, .*; got prompt"):
        read_request(1, b'{"prompt": "x"}', classifier=False, transduces=True)
    with pytest.raises(RowError, match="source: expected a string, got int"):
        read_request(1, b'{"source": 5}', classifier=False, transduces=True)


@pytest.mark.slow
def test_t5_learns_to_write_numbers_registers_and_predicts_as_evaluated(tmp_path: Path) -> None:
    from llmops.registry.gate import score_version

    config = tiny_config(CONFIG, write_pairs(tmp_path / "pairs.jsonl", 1500))
    records = run_all_stages(config, "seq2seq-test")
    figures = records["evaluate"].figures
    trained, untrained = figures.metrics["trained"], figures.metrics["untrained"]
    print(f"held-out exact match {trained['exact_match']:.3f} (untrained {untrained['exact_match']:.3f}), ROUGE-L "
          f"{trained['rouge_l']:.3f} ({untrained['rouge_l']:.3f}), {records['train'].figures.steps} steps in "
          f"{records['train'].figures.seconds:.1f} s")
    assert figures.primary_metric == "exact_match"
    assert trained["exact_match"] > untrained["exact_match"] + 0.4
    assert trained["rouge_l"] > untrained["rouge_l"] + 0.5
    assert trained["completion_perplexity"] < untrained["completion_perplexity"] / 10
    registered = records["register"]
    assert registered.alias == "champion"

    # the registry holds a text2text-generation model that the gate re-scores exactly as evaluation scored it
    uri = f"models:/{registered.model_name}/{registered.version}"
    import mlflow

    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(tmp_path / "dl")))
    assert yaml.safe_load((local / "MLmodel").read_text())["flavors"]["transformers"]["task"] == seq2seq.TASK
    heldout = list(read_jsonl(records["evaluate"].dir / "heldout.jsonl"))
    rescored = score_version(config, uri, heldout)
    assert rescored.values()["exact_match"] == pytest.approx(trained["exact_match"])

    samples = list(read_jsonl(records["evaluate"].dir / "samples.jsonl"))
    write_jsonl(tmp_path / "rows.jsonl", [{"input": row["source"], "target": row["target"]} for row in heldout])
    result = CliRunner().invoke(app, ["predict", f"{registered.model_name}/{registered.version}", "--input",
                                      str(tmp_path / "rows.jsonl"), "--batch-size", str(len(heldout))])
    assert result.exit_code == 0, result.output
    answers = [json.loads(line) for line in result.stdout.splitlines()]
    assert [a["output"] for a in answers] == [s["trained_output"] for s in samples]
    assert [a["reference"] for a in answers] == [row["target"] for row in heldout]
    right = sum(a["output"] == a["reference"] for a in answers) / len(answers)
    assert right == pytest.approx(trained["exact_match"])
