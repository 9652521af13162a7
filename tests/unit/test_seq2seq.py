"""Sequence-to-sequence: column mapping, quarantine, target labels, predict rows (a T5 trained, registered and
predicted with: tests/integration/test_seq2seq_e2e.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from llmops.config.schema import DataConfig, LoraConfig, ModelConfig
from llmops.data.ingest import read_records
from llmops.data.synthetic import pair_records, words_task
from llmops.data.tokenize import training_texts
from llmops.io.errors import ConfigError
from llmops.io.files import read_jsonl, write_jsonl
from llmops.io.tables import table_rows
from llmops.models import modeling
from llmops.objectives import selected
from llmops.objectives.base import Encoding, RowError, Served
from llmops.objectives.config import complete
from llmops.registry.loading import LoadedVersion
from llmops.serving.predict import read_request
from llmops.text.encoding import IGNORE_INDEX
from llmops.text.tokenizers import prepare_tokenizer
from tests.conftest import tiny_config
from tests.helpers import stage

CONFIG = "tiny_seq2seq_cpu.yaml"
TINY_T5 = ModelConfig(architecture="t5", hidden_size=16, num_layers=1, num_heads=2)
OBJECTIVE = selected(DataConfig(kind="seq2seq"))


def lines_file(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    corpus = write_pairs(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", 200)
    trained = OBJECTIVE.train_tokenizer(training_texts(read_jsonl(corpus), OBJECTIVE), 320)
    prepare_tokenizer(trained, None, trained_here=True)
    return trained


def write_pairs(path: Path, rows: int) -> Path:
    write_jsonl(path, pair_records(words_task, rows, seed=7))
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
    ingested = stage("ingest", tiny_config(CONFIG, data))
    records = [{k: v for k, v in row.items() if not k.startswith("_")}
               for row in read_records(ingested.dir)]
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
    config = complete({**tiny_config(CONFIG, data).as_dict(), "data": {
        "kind": "seq2seq", "path": str(data), "columns": {"source": "en", "target": "de"}}})
    row = next(iter(read_records(stage("ingest", config).dir)))
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
    validated = stage("validate", config, stage("ingest", config))
    # a file outside the project is named by its absolute path
    found = {(row["source"].replace(str(tmp_path) + "/", ""), row["line"], row["code"], row["field"])
             for row in read_jsonl(validated.dir / "quarantine.jsonl")}
    assert {row["source"] for row in read_jsonl(validated.dir / "quarantine.jsonl")} == {str(data)}
    assert found == {("bad.jsonl", 2, "missing_field", "target"), ("bad.jsonl", 3, "wrong_type", "source"),
                     ("bad.jsonl", 4, "empty", "target"), ("bad.jsonl", 5, "nul_byte", "source"),
                     ("bad.jsonl", 6, "control_char", "target"), ("bad.jsonl", 7, "too_long", "source"),
                     ("bad.jsonl", 8, "missing_field", "target")}
    messages = {row["line"]: row["message"] for row in read_jsonl(validated.dir / "quarantine.jsonl")}
    assert messages[3] == "source: a number where text is expected"
    assert messages[7] == "source: 80 characters, over validate.max_chars (50)"
    assert [row["_line"] for row in table_rows(validated.dir / "valid")] == [1, 9]


def test_labels_are_the_target_ids_and_padding_is_ignored(tokenizer: Any) -> None:
    rows = [{"source": "4211", "target": "four thousand two hundred eleven"}, {"source": "7", "target": "seven"}]
    config = tiny_config(CONFIG, Path("unused.jsonl"))
    encoded = selected(config.data).encode(tokenizer, rows, Encoding(32, tuple(config.data.labels),
                                                                     config.tokenize.stride))
    eos = tokenizer.eos_token_id
    for row, ids, labels in zip(rows, encoded["input_ids"], encoded["labels"], strict=True):
        assert ids == tokenizer(row["source"])["input_ids"] + [eos]
        assert labels == tokenizer(row["target"])["input_ids"] + [eos]
        assert tokenizer.decode(labels, skip_special_tokens=True) == row["target"]
    model = OBJECTIVE.build_model(TINY_T5, tokenizer, 0, [])
    collate = OBJECTIVE.meter(tokenizer, model, False, 32, 0)
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
    encoded = OBJECTIVE.encode(tokenizer, [{"source": "1234567890" * 2, "target": "one two"}], Encoding(8))
    assert len(encoded["input_ids"][0]) == 8 and encoded["raw_length"] == [21]
    assert encoded["labels"][0][-1] == tokenizer.eos_token_id  # the target was short enough to keep its end


def test_seq2seq_from_scratch_needs_t5_and_names_the_setting(tmp_path: Path) -> None:
    # refused when the config is loaded, before any stage runs
    with pytest.raises(ConfigError, match="model.architecture: seq2seq builds t5 from scratch \\(got llama\\)") \
            as caught:
        tiny_config(CONFIG, tmp_path / "pairs.jsonl", "model.architecture=llama")
    assert "\n" not in str(caught.value)


def test_lora_adapter_on_a_seq2seq_base_saves_and_loads_back(tokenizer: Any, tmp_path: Path) -> None:
    import torch

    base = OBJECTIVE.build_model(TINY_T5, tokenizer, 0, [])
    base.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    adapted_config = ModelConfig(name_or_path=str(tmp_path / "base"), adapter="lora", lora=LoraConfig(r=4))
    model = OBJECTIVE.with_adapter(OBJECTIVE.build_model(adapted_config, tokenizer, 0, []), adapted_config, False)
    assert type(model).__name__ == "PeftModelForSeq2SeqLM"
    assert 0 < modeling.parameter_counts(model)["trainable_parameters"] < modeling.parameter_counts(base)["parameters"]
    model.save_pretrained(tmp_path / "adapter")
    loaded = OBJECTIVE.load_trained(tmp_path / "adapter")
    ids = torch.tensor([tokenizer("42")["input_ids"] + [tokenizer.eos_token_id]])
    assert torch.equal(loaded.generate(input_ids=ids, max_new_tokens=4), model.generate(input_ids=ids,
                                                                                         max_new_tokens=4))


def version() -> LoadedVersion:
    """A seq2seq version as predict holds it; reading its rows needs neither model nor tokenizer."""
    served = Served(model=None, tokenizer=None, labels=None, encoding=Encoding(32), max_new_tokens=16)
    return LoadedVersion(name="pairs", version="1", objective=OBJECTIVE, task=OBJECTIVE.task, served=served)


@pytest.mark.parametrize(("row", "source", "reference"), [
    ({"source": "4211", "target": "four thousand two hundred eleven"}, "4211", "four thousand two hundred eleven"),
    ({"input": "12"}, "12", None),
    ({"text": "7", "answer": "seven"}, "7", "seven"),
    ({"document": "a report", "summary": "short"}, "a report", "short"),
])
def test_predict_rows_name_their_source_as_ingest_does(row: dict, source: str, reference: str | None) -> None:
    request = read_request(version(), 3, json.dumps(row).encode())
    assert (request.ask, request.fields["source"], request.reference, request.line) == ("seq2seq", source,
                                                                                         reference, 3)


def test_predict_row_without_a_source_says_which_fields_it_reads() -> None:
    with pytest.raises(RowError, match="expected a source field \\(source, input, .*; got prompt"):
        read_request(version(), 1, b'{"prompt": "x"}')
    with pytest.raises(RowError, match="source: expected a string, got int"):
        read_request(version(), 1, b'{"source": 5}')
