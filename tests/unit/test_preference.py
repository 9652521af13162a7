"""Preference optimization: pairs ingested from common column names, unfit pairs quarantined by line, a registered
SFT version as the starting model, and DPO raising the held-out preference accuracy over it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from llmops.core import tracking, workspace
from llmops.core.config import DataConfig, PipelineConfig, load_config
from llmops.core.workspace import write_jsonl
from llmops.data.ingest import ingest
from llmops.data.synthetic import instruction_records, preference_records
from llmops.data.tokenize import IGNORE_INDEX, Encoder, prepare_tokenizer, train_tokenizer
from llmops.data.validate import validate
from llmops.registry.registered_base import RegisteredBaseError, local_name
from llmops.serving import predict
from tests.unit.helpers import run_all_stages

REPO = Path(__file__).resolve().parents[2]


def preference_config(path: Path, *overrides: str) -> PipelineConfig:
    return load_config(REPO / "configs" / "tiny_dpo_cpu.yaml", [f"data.path={path}", *overrides])


def quarantined(config: PipelineConfig) -> list[dict[str, Any]]:
    validated = validate(config, ingest(config))
    return list(workspace.read_jsonl(validated.dir / "quarantine.jsonl"))


def test_common_column_names_map_to_prompt_chosen_and_rejected(tmp_path: Path) -> None:
    rows = [{"question": "Q1", "response_chosen": "good", "response_rejected": "bad"},
            {"instruction": "Q2", "preferred": "yes", "dispreferred": "no"},
            {"prompt": [{"role": "user", "content": "Q3"}], "chosen": [{"role": "assistant", "content": "a"}],
             "rejected": [{"role": "assistant", "content": "b"}]},
            {"ask": "Q4", "win": "w", "lose": "l"}]
    write_jsonl(tmp_path / "pairs.jsonl", rows)
    config = preference_config(tmp_path / "pairs.jsonl")
    records = list(workspace.read_jsonl(ingest(config).dir / "records.jsonl"))
    assert [(r["prompt"], r["chosen"], r["rejected"]) for r in records[:2]] == [("Q1", "good", "bad"),
                                                                                 ("Q2", "yes", "no")]
    assert records[2]["chosen"] == [{"role": "assistant", "content": "a"}]
    assert (records[3]["prompt"], records[3]["chosen"]) == (None, None)
    mapped = preference_config(tmp_path / "pairs.jsonl", "data.columns={prompt: ask, chosen: win, rejected: lose}")
    last = list(workspace.read_jsonl(ingest(mapped).dir / "records.jsonl"))[3]
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
    tokenizer = train_tokenizer(tmp_path / "i.jsonl", "instruction", 300)
    prepare_tokenizer(tokenizer, None, trained_here=True)
    sft = Encoder(tokenizer, DataConfig(kind="instruction"), 64)(rows[:6])
    pairs = [{"prompt": f"{r['instruction']}\n\n{r['input']}", "chosen": r["output"], "rejected": "no idea"}
             for r in rows[:6]]
    encoded = Encoder(tokenizer, DataConfig(kind="preference"), 64)(pairs)
    for index in range(6):
        answer = [token for token in sft["labels"][index] if token != IGNORE_INDEX]
        prompt = encoded["prompt_ids"][index]
        assert encoded["chosen_ids"][index] == answer
        assert sft["input_ids"][index][:len(prompt) + len(answer)] == prompt + answer
        assert tokenizer.decode(encoded["rejected_ids"][index]) == "no idea<|end|>"
    short = Encoder(tokenizer, DataConfig(kind="preference"), len(encoded["prompt_ids"][0]) + 2)(pairs[:1])
    assert len(short["chosen_ids"][0]) == len(short["rejected_ids"][0]) == 2 and short["has_target"] == [True]


def test_an_unknown_registered_base_is_one_line_naming_the_key() -> None:
    config = load_config(REPO / "configs" / "tiny_dpo_cpu.yaml", ["register.model_name=other"])
    with pytest.raises(RegisteredBaseError) as raised:
        local_name("models:/no-such-model@champion", config.tracking)
    message = str(raised.value)
    assert message.startswith("model.name_or_path models:/no-such-model@champion: no registered model "
                              "'no-such-model'") and "\n" not in message
    with pytest.raises(RegisteredBaseError, match="expected models:/NAME@alias or models:/NAME/VERSION"):
        local_name("models:/a/b/c", config.tracking)


@pytest.mark.slow
def test_dpo_from_the_registered_sft_champion_raises_preference_accuracy(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "instructions.jsonl", instruction_records(1200, seed=11))
    write_jsonl(tmp_path / "pairs.jsonl", preference_records(900, seed=12))
    started = time.perf_counter()
    sft = load_config(REPO / "configs" / "tiny_sft_cpu.yaml", [
        f"data.path={tmp_path / 'instructions.jsonl'}", "train.epochs=3", "evaluate.max_examples=20",
        "evaluate.primary_metric=completion_loss", "register.model_name=tiny-sft"])
    assert run_all_stages(sft, "sft")["register"].alias == "champion"
    sft_seconds = time.perf_counter() - started

    dpo = preference_config(tmp_path / "pairs.jsonl", "model.name_or_path=models:/tiny-sft@champion",
                            "data.eval_fraction=0.15", "register.model_name=tiny-dpo")
    records = run_all_stages(dpo, "dpo")
    figures = records["evaluate"].figures
    trained, start = figures.metrics["trained"], figures.metrics["base"]
    dpo_seconds = time.perf_counter() - started - sft_seconds
    print(f"\nheld-out pairs {figures.examples}: preference_accuracy SFT {start['preference_accuracy']:.3f} -> DPO "
          f"{trained['preference_accuracy']:.3f}; reward_margin {start['reward_margin']:.3f} -> "
          f"{trained['reward_margin']:.3f}; SFT {sft_seconds:.0f} s, DPO {dpo_seconds:.0f} s")
    assert figures.primary_metric == "preference_accuracy" and figures.baseline == "base"
    assert start["reward_margin"] == 0.0
    assert trained["preference_accuracy"] > start["preference_accuracy"] + 0.04
    assert trained["reward_margin"] > 0.3 and figures.gain_over_baseline["reward_margin"]["low"] > 0
    registration = records["register"]
    assert registration.alias == "champion" and registration.model_name == "tiny-dpo"
    version = tracking.client(dpo.tracking).get_model_version("tiny-dpo", registration.version)
    assert json.loads(version.tags["packages"])["trl"]
    predictor = predict.load(predict.parse_reference("tiny-dpo@champion"), dpo.tracking)
    rows = [b'{"messages": [{"role": "user", "content": "Write this date in words.\\n\\n2031-05-17"}]}',
            b'{"instruction": "Write this number in words.", "input": "42", "output": "forty-two"}']
    answers = list(predict.predict_lines(predictor, rows, batch_size=4))
    assert all(isinstance(answer["output"], str) for answer in answers) and answers[1]["reference"] == "forty-two"
