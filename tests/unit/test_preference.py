"""Preference optimization: pairs ingested from common column names, unfit pairs quarantined by line, pairs encoded
as SFT encodes, a registered starting model that does not exist (DPO from a registered SFT version raising the
held-out preference accuracy: tests/integration/test_preference_e2e.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llmops.config.schema import DataConfig, PipelineConfig
from llmops.data.ingest import read_records
from llmops.data.synthetic import instruction_records, preference_records
from llmops.data.tokenize import training_texts
from llmops.io.files import read_jsonl, write_jsonl
from llmops.objectives import load_config, selected
from llmops.objectives.base import Encoding
from llmops.registry.bases import RegisteredBaseError, local_folder
from llmops.text.encoding import IGNORE_INDEX
from llmops.text.tokenizers import prepare_tokenizer
from tests.helpers import stage

REPO = Path(__file__).resolve().parents[2]


def preference_config(path: Path, *overrides: str) -> PipelineConfig:
    return load_config(REPO / "configs" / "tiny_dpo_cpu.yaml", [f"data.path={path}", *overrides])


def quarantined(config: PipelineConfig) -> list[dict[str, Any]]:
    validated = stage("validate", config, stage("ingest", config))
    return list(read_jsonl(validated.dir / "quarantine.jsonl"))


def test_common_column_names_map_to_prompt_chosen_and_rejected(tmp_path: Path) -> None:
    rows = [{"question": "Q1", "response_chosen": "good", "response_rejected": "bad"},
            {"instruction": "Q2", "preferred": "yes", "dispreferred": "no"},
            {"prompt": [{"role": "user", "content": "Q3"}], "chosen": [{"role": "assistant", "content": "a"}],
             "rejected": [{"role": "assistant", "content": "b"}]},
            {"ask": "Q4", "win": "w", "lose": "l"}]
    write_jsonl(tmp_path / "pairs.jsonl", rows)
    config = preference_config(tmp_path / "pairs.jsonl")
    ingested = stage("ingest", config)
    records = list(read_records(ingested.dir))
    assert [(r["prompt"], r["chosen"], r["rejected"]) for r in records[:2]] == [("Q1", "good", "bad"),
                                                                                 ("Q2", "yes", "no")]
    assert records[2]["chosen"] == [{"role": "assistant", "content": "a"}]
    # a row with none of the kind's columns is rejected, naming the ones it has
    (unmapped,) = read_jsonl(ingested.dir / "rejected.jsonl")
    assert len(records) == 3 and (unmapped["line"], unmapped["code"]) == (4, "missing_field")
    assert "which holds 'ask', 'win', 'lose'" in unmapped["message"]
    mapped = preference_config(tmp_path / "pairs.jsonl", "data.columns={prompt: ask, chosen: win, rejected: lose}")
    # mapped, the other rows hold none of the mapped columns: only the last is a record
    (last,) = read_records(stage("ingest", mapped).dir)
    assert (last["prompt"], last["chosen"], last["rejected"]) == ("Q4", "w", "l")


def test_unfit_pairs_are_quarantined_with_file_line_field_and_code(tmp_path: Path) -> None:
    good = preference_records(40, seed=2)
    bad = [
        {"prompt": "Spell 12.", "chosen": "twelve", "rejected": " twelve\n"},                      # line 41
        {"prompt": "Spell 3.", "chosen": "three", "rejected": "   "},                              # line 42
        {"prompt": [{"role": "assistant", "content": "hi"}], "chosen": "a", "rejected": "b"},     # line 43
        {"prompt": "Spell 4.", "chosen": [{"role": "user", "content": "four"}], "rejected": "x"},  # line 44
        {"prompt": "Spell 5.", "chosen": "five"},                                                  # line 45
        {"prompt": "Spell 6.", "chosen": 6, "rejected": "seven"},                                  # line 46
        {"prompt": "", "chosen": "a", "rejected": "b"},                                            # line 47
    ]
    write_jsonl(tmp_path / "pairs.jsonl", good + bad)
    entries = {entry["line"]: entry for entry in quarantined(preference_config(tmp_path / "pairs.jsonl",
                                                                               "validate.max_bad_fraction=0.5"))}
    found = {line: (entry["code"], entry["field"]) for line, entry in entries.items()}
    assert found == {41: ("same_answers", "rejected"), 42: ("empty", "rejected"), 43: ("chat_order", "prompt"),
                     44: ("chat_order", "chosen"), 45: ("missing_field", "rejected"), 46: ("wrong_type", "chosen"),
                     47: ("empty", "prompt")}
    assert all(entry["source"].endswith("pairs.jsonl") for entry in entries.values())
    assert "roles 'assistant' are out of order" in entries[43]["message"]
    assert "same answer as chosen" in entries[41]["message"]


def test_a_pair_is_encoded_as_sft_encodes_its_prompt_and_answer(tmp_path: Path) -> None:
    """The prompt and the answer's tokens (end-of-turn marker included) are the ones SFT trains on."""
    rows = instruction_records(60, seed=3)
    write_jsonl(tmp_path / "i.jsonl", rows)
    sft_objective, dpo = selected(DataConfig(kind="instruction")), selected(DataConfig(kind="preference"))
    tokenizer = sft_objective.train_tokenizer(training_texts(read_jsonl(tmp_path / "i.jsonl"), sft_objective), 300)
    prepare_tokenizer(tokenizer, None, trained_here=True)
    sft = sft_objective.encode(tokenizer, rows[:6], Encoding(64))
    pairs = [{"prompt": f"{r['instruction']}\n\n{r['input']}", "chosen": r["output"], "rejected": "no idea"}
             for r in rows[:6]]
    encoded = dpo.encode(tokenizer, pairs, Encoding(64))
    for index in range(6):
        answer = [token for token in sft["labels"][index] if token != IGNORE_INDEX]
        prompt = encoded["prompt_ids"][index]
        assert encoded["chosen_ids"][index] == answer
        assert sft["input_ids"][index][:len(prompt) + len(answer)] == prompt + answer
        assert tokenizer.decode(encoded["rejected_ids"][index]) == "no idea<|end|>"
    short = dpo.encode(tokenizer, pairs[:1], Encoding(len(encoded["prompt_ids"][0]) + 2))
    assert len(short["chosen_ids"][0]) == len(short["rejected_ids"][0]) == 2 and short["has_target"] == [True]


def test_an_unknown_registered_base_is_one_line_naming_the_key() -> None:
    config = load_config(REPO / "configs" / "tiny_dpo_cpu.yaml", ["register.model_name=other"])
    with pytest.raises(RegisteredBaseError) as raised:
        local_folder("models:/no-such-model@champion", config.tracking)
    message = str(raised.value)
    assert message.startswith("model.name_or_path models:/no-such-model@champion: no registered model "
                              "'no-such-model'") and "\n" not in message
    # the one grammar of a version's name (a models:/ prefix allowed)
    with pytest.raises(RegisteredBaseError, match="models:/a/b/c: .*expected NAME, NAME@alias or NAME/VERSION"):
        local_folder("models:/a/b/c", config.tracking)
