"""Feedback records and the methods beyond DPO: feedback ingested from common column names, unfit rows quarantined by
file, line and field, a completion encoded as SFT encodes a response, ORPO's and KTO's batches, and the held-out
ranking metrics (training and registering both: tests/integration/test_orpo_kto_e2e.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llmops.config.schema import DataConfig, PipelineConfig
from llmops.data.ingest import read_records
from llmops.data.synthetic import feedback_records, instruction_records, number_in_words, preference_records
from llmops.data.tokenize import training_texts
from llmops.io.files import read_jsonl, write_jsonl
from llmops.objectives import load_config, selected
from llmops.objectives.base import Encoding
from llmops.objectives.kto import METRICS, FeedbackMeter, by_label, mismatched, placements
from llmops.objectives.metrics import value
from llmops.objectives.orpo import OddsRatioMeter, PairCollator
from llmops.text.encoding import IGNORE_INDEX
from llmops.text.tokenizers import prepare_tokenizer
from tests.helpers import stage

REPO = Path(__file__).resolve().parents[2]


def feedback_config(path: Path, *overrides: str) -> PipelineConfig:
    return load_config(REPO / "configs" / "tiny_kto_cpu.yaml", [f"data.path={path}", *overrides])


def ingested(config: PipelineConfig) -> list[dict[str, Any]]:
    return list(read_records(stage("ingest", config).dir))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A BPE tokenizer trained here, with the chat template SFT renders with."""
    path = tmp_path_factory.mktemp("tokenizer") / "i.jsonl"
    write_jsonl(path, instruction_records(60, seed=3))
    sft = selected(DataConfig(kind="instruction"))
    trained = sft.train_tokenizer(training_texts(read_jsonl(path), sft), 300)
    prepare_tokenizer(trained, None, trained_here=True)
    return trained


def test_common_column_names_map_to_prompt_completion_and_label(tmp_path: Path) -> None:
    rows = [{"question": "Q1", "response": "good", "desirable": True},
            {"instruction": "Q2", "output": "bad", "is_desirable": False},
            {"prompt": [{"role": "user", "content": "Q3"}], "completion": [{"role": "assistant", "content": "a"}],
             "label": False},
            {"ask": "Q4", "reply": "r", "thumbs": True}]
    write_jsonl(tmp_path / "feedback.jsonl", rows)
    config = feedback_config(tmp_path / "feedback.jsonl")
    records = ingested(config)
    assert [(r["prompt"], r["completion"], r["label"]) for r in records[:2]] == [("Q1", "good", True),
                                                                                 ("Q2", "bad", False)]
    assert records[2]["completion"] == [{"role": "assistant", "content": "a"}] and records[2]["label"] is False
    # a row with none of the kind's columns is rejected, naming the ones it has
    (unmapped,) = read_jsonl(stage("ingest", config).dir / "rejected.jsonl")
    assert len(records) == 3 and (unmapped["line"], unmapped["code"]) == (4, "missing_field")
    assert "which holds 'ask', 'reply', 'thumbs'" in unmapped["message"]
    columns = "data.columns={prompt: ask, completion: reply, label: thumbs}"
    mapped = feedback_config(tmp_path / "feedback.jsonl", columns)
    # mapped, the other rows hold none of the mapped columns: only the last is a record
    (last,) = ingested(mapped)
    assert [last[field] for field in ("prompt", "completion", "label")] == ["Q4", "r", True]


def test_unfit_feedback_is_quarantined_with_file_line_field_and_code(tmp_path: Path) -> None:
    good = feedback_records(40, seed=2)
    bad = [
        {"prompt": "Spell 12.", "completion": "twelve"},                                           # line 41
        {"prompt": "Spell 3.", "completion": "   ", "label": True},                                # line 42
        {"prompt": "Spell 5.", "completion": "five", "label": "yes"},                              # line 43
        {"prompt": "Spell 6.", "completion": "six", "label": None},                                # line 44
        {"prompt": "Spell 7.", "label": False},                                                    # line 45
        {"prompt": "Spell 8.", "completion": [{"role": "user", "content": "eight"}], "label": True},  # line 46
        {"prompt": [{"role": "assistant", "content": "hi"}], "completion": "a", "label": True},   # line 47
        {"prompt": "Spell 9.", "completion": [{"role": "assistant", "content": ""}], "label": False},  # line 48
        {"prompt": "Spell 1.", "completion": 1, "label": 1},                                       # line 49
    ]
    write_jsonl(tmp_path / "feedback.jsonl", good + bad)
    config = feedback_config(tmp_path / "feedback.jsonl", "validate.max_bad_fraction=0.5")
    validated = stage("validate", config, stage("ingest", config))
    entries = {entry["line"]: entry for entry in read_jsonl(validated.dir / "quarantine.jsonl")}
    found = {line: (entry["code"], entry["field"]) for line, entry in entries.items()}
    assert found == {41: ("missing_field", "label"), 42: ("empty", "completion"), 43: ("wrong_type", "label"),
                     44: ("missing_field", "label"), 45: ("missing_field", "completion"),
                     46: ("chat_order", "completion"), 47: ("chat_order", "prompt"), 48: ("empty", "completion"),
                     49: ("wrong_type", "completion")}
    assert all(entry["source"].endswith("feedback.jsonl") for entry in entries.values())
    assert entries[41]["message"].startswith("label: missing (expected true for a desirable completion")
    assert entries[43]["message"] == ("label: a string ('yes') where true (desirable) or false (undesirable) is "
                                      "expected")
    assert entries[42]["message"] == "completion: empty or only whitespace"
    assert validated.figures.rows_kept == 40 and validated.figures.codes["missing_field"] == 3


def test_a_completion_is_encoded_as_sft_encodes_a_response(tokenizer: Any) -> None:
    """The prompt and the completion's tokens (end-of-turn marker included) are the ones SFT trains on; the label
    rides along, and a completion is cut to leave the prompt whole."""
    rows = instruction_records(6, seed=5)
    sft = selected(DataConfig(kind="instruction")).encode(tokenizer, rows, Encoding(64))
    feedback = [{"prompt": f"{r['instruction']}\n\n{r['input']}", "completion": r["output"], "label": i % 2 == 0}
                for i, r in enumerate(rows)]
    kto = selected(DataConfig(kind="feedback"))
    encoded = kto.encode(tokenizer, feedback, Encoding(64))
    for index in range(6):
        answer = [token for token in sft["labels"][index] if token != IGNORE_INDEX]
        prompt = encoded["prompt_ids"][index]
        assert encoded["completion_ids"][index] == answer == encoded["labels"][index]
        assert sft["input_ids"][index][:len(prompt) + len(answer)] == prompt + answer
        assert tokenizer.decode(encoded["completion_ids"][index]).endswith("<|end|>")
    assert encoded["label"] == [True, False, True, False, True, False] and all(encoded["has_target"])
    room = len(encoded["prompt_ids"][0]) + 2
    short = kto.encode(tokenizer, feedback[:1], Encoding(room))
    assert len(short["completion_ids"][0]) == 2 and short["length"] == [room] and short["has_target"] == [True]
    assert kto.encode(tokenizer, feedback[:1], Encoding(room - 2))["has_target"] == [False]


def test_orpo_batches_hold_each_answer_after_its_prompt_with_the_prompt_unlabelled(tokenizer: Any) -> None:
    orpo = selected(DataConfig(kind="preference", objective="orpo"))
    pairs = orpo.encode(tokenizer, preference_records(4, seed=1), Encoding(64))
    rows = [{name: pairs[name][index] for name in ("prompt_ids", "chosen_ids", "rejected_ids")} | {"sample": index}
            for index in range(4)]
    meter = OddsRatioMeter(PairCollator(pad_token_id=tokenizer.pad_token_id))
    batch = meter(rows)
    for index, row in enumerate(rows):
        prompt, chosen = row["prompt_ids"], row["chosen_ids"]
        width = len(prompt) + len(chosen)
        assert batch["chosen_input_ids"][index, :width].tolist() == prompt + chosen
        assert batch["chosen_labels"][index, :width].tolist() == [IGNORE_INDEX] * len(prompt) + chosen
        assert batch["rejected_labels"][index, len(prompt):].tolist()[:len(row["rejected_ids"])] == row["rejected_ids"]
        assert batch["chosen_attention_mask"][index].sum() == width
    real = sum(2 * len(r["prompt_ids"]) + len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in rows)
    figures = meter.measure(rows)[1]
    assert figures.real == real
    assert figures.slots == batch["chosen_input_ids"].numel() + batch["rejected_input_ids"].numel()


def test_kto_batches_pair_each_prompt_with_its_neighbours_completion_for_the_kl_term(tokenizer: Any) -> None:
    kto = selected(DataConfig(kind="feedback"))
    encoded = kto.encode(tokenizer, feedback_records(4, seed=1), Encoding(64))
    rows = [{"prompt_ids": encoded["prompt_ids"][i], "completion_ids": encoded["completion_ids"][i],
             "label": encoded["label"][i]} for i in range(4)]
    completions = [row["completion_ids"] for row in rows]
    assert mismatched({"completion_ids": completions})["KL_completion_ids"] == [completions[3], *completions[:3]]
    rows = [{**row, "KL_completion_ids": kl} for row, kl in zip(rows, [completions[3], *completions[:3]], strict=True)]
    meter = kto.meter(tokenizer, None, False, 64, 0)
    assert isinstance(meter, FeedbackMeter)
    batch = meter(rows)
    assert batch["label"].tolist() == encoded["label"]
    assert batch["completion_mask"][0].sum() == len(completions[0]) and batch["KL_completion_mask"][0].sum() == \
        len(completions[3])
    assert meter.measure(rows)[1].real == sum(2 * len(r["prompt_ids"]) + len(r["completion_ids"]) +
                                              len(r["KL_completion_ids"]) for r in rows)


def test_placement_values_average_to_the_auc_and_ties_count_half() -> None:
    scores = np.array([0.9, 0.1, 0.8, 0.4, 0.4, 0.2])
    labels = np.array([True, False, True, False, True, False])
    # desirable 0.9, 0.8, 0.4 against undesirable 0.1, 0.4, 0.2: 3 + 3 + (2 + 0.5) wins of 9
    assert value(METRICS["reward_auc"], placements(scores, labels)) == pytest.approx(8.5 / 9)
    assert value(METRICS["reward_auc"], placements(np.zeros(6), labels)) == 0.5
    assert np.isnan(value(METRICS["reward_auc"], placements(scores, np.ones(6, dtype=bool))))
    margin = by_label(scores, labels)
    assert value(METRICS["reward_margin"], margin) == pytest.approx(0.7 - 0.7 / 3)


def test_kto_and_orpo_configs_select_their_objectives_with_a_lora_adapter() -> None:
    kto, orpo = (load_config(REPO / "configs" / name) for name in ("tiny_kto_cpu.yaml", "tiny_orpo_cpu.yaml"))
    assert (selected(kto.data).name, selected(orpo.data).name) == ("kto", "orpo")
    assert kto.model.adapter == orpo.model.adapter == "lora"
    assert selected(kto.data).primary(None, [])[0] == "reward_auc"
    assert selected(orpo.data).primary(None, [])[0] == "preference_accuracy"


def test_example_feedback_is_balanced_and_labelled_by_correctness() -> None:
    rows = feedback_records(400)
    assert rows == feedback_records(400)
    assert 0.4 < sum(row["label"] for row in rows) / len(rows) < 0.6
    words = [row for row in rows if row["prompt"].startswith("Write this number in words.")]
    assert words and all((number_in_words(int(row["prompt"].split()[-1])) == row["completion"]) == row["label"]
                         for row in words)


def test_kto_with_one_row_per_batch_is_refused_in_one_line() -> None:
    """KTO's KL term pairs rows within a batch: TRL refuses a batch of one deep in training; the config check says it
    before anything runs."""
    from llmops.io.errors import ConfigError
    from llmops.objectives import load_config

    with pytest.raises(ConfigError, match="train.batch_size") as caught:
        load_config(REPO / "configs" / "tiny_kto_cpu.yaml", ["train.batch_size=1"])
    assert "\n" not in str(caught.value)
