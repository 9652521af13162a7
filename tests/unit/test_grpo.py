"""GRPO with verifiable rewards: each reward against hand-computed values, the weights TRL combines them with, bad
reward settings as one line, the prompts record kind (common columns, quarantine, encoding as evaluation prompts).
GRPO raising held-out exact match over its SFT start through the gate: tests/integration/test_grpo_e2e.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llmops.config.grpo import GrpoConfig, RewardConfig
from llmops.config.schema import DataConfig, PipelineConfig
from llmops.data.ingest import read_records
from llmops.data.synthetic import instruction_records, prompt_records
from llmops.data.tokenize import training_texts
from llmops.io.errors import ConfigError
from llmops.io.files import read_jsonl, write_jsonl
from llmops.io.tables import table_rows
from llmops.objectives import load_config, selected
from llmops.objectives.base import Encoding
from llmops.objectives.rewards import build, parse_number
from llmops.records.prompts import answer_text
from llmops.text.templates import render
from llmops.text.tokenizers import prepare_tokenizer
from tests.helpers import stage

REPO = Path(__file__).resolve().parents[2]


def answers_in_roman(completions: list[str], **_: Any) -> list[float]:
    """A reward of one's own, named by its dotted path in a config below."""
    return [1.0 if completion and set(completion) <= set("IVXLCDM") else -1.0 for completion in completions]


def rewards_of(*entries: dict[str, Any]) -> dict[str, list[float | None]]:
    functions, _ = build(GrpoConfig(rewards=[RewardConfig(**entry) for entry in entries]))
    batch = {"prompts": ["p"] * 4, "completions": ["XII", " XII ", "twelve", "It is 1,234."],
             "answer": ["XII", "XII", "XII", None]}
    return {function.__name__: function(**batch) for function in functions}


def grpo_config(path: Path, *overrides: str) -> PipelineConfig:
    return load_config(REPO / "configs" / "tiny_grpo_cpu.yaml", [f"data.path={path}", *overrides])


def test_each_reward_scores_completions_as_computed_by_hand() -> None:
    scored = rewards_of({"name": "exact_match"}, {"name": "rouge_l"}, {"name": "chrf"},
                        {"name": "regex", "pattern": r"^\s*[IVXLCDM]+\s*$"},
                        {"name": "function", "function": "tests.unit.test_grpo.answers_in_roman"})
    # surrounding whitespace aside, as held-out exact match counts; a record without an answer is not judged
    assert scored["exact_match"] == [1.0, 1.0, 0.0, None]
    assert scored["rouge_l"] == [1.0, 1.0, 0.0, None]
    assert scored["chrf"][:2] == [1.0, 1.0] and scored["chrf"][2] == 0.0 and scored["chrf"][3] is None
    assert scored["regex"] == [1.0, 1.0, 0.0, 0.0]
    assert scored["function"] == [1.0, -1.0, -1.0, -1.0]
    # ROUGE-L F1: 3 words in common of 3 and 4 -> 2 * 1 * 0.75 / 1.75
    partial = rewards_of({"name": "rouge_l"})  # "twelve" shares nothing with XII
    assert partial["rouge_l"][2] == 0.0
    functions, _ = build(GrpoConfig(rewards=[RewardConfig(name="rouge_l")]))
    value = functions[0](completions=["four thousand two"], answer=["four thousand two hundred"])[0]
    assert value == pytest.approx(2 * 0.75 / 1.75)


def test_numeric_match_reads_the_last_number_with_separators_and_decimals() -> None:
    functions, _ = build(GrpoConfig(rewards=[RewardConfig(name="numeric_match")]))
    completions = ["It is 1,234.", "1234.0", "about 12 or 13", "none", "-0.50", "3"]
    answers = ["1234", "1,234", "13", "5", "-.5", None]
    assert functions[0](completions=completions, answer=answers) == [1.0, 1.0, 1.0, 0.0, 1.0, None]
    assert parse_number("between 1 000 000 and 2_000") == 2000.0 and parse_number("no digits") is None


def test_rewards_are_weighted_and_named_for_their_figures(tmp_path: Path) -> None:
    config = grpo_config(tmp_path / "p.jsonl", "grpo.rewards=[{name: exact_match, weight: 2}, {name: chrf, "
                         "weight: 0.25}, {name: exact_match}, {name: regex, pattern: '^X', label: starts_x}]")
    objective = selected(config.data)
    functions, weights = build(config.grpo)
    assert [f.__name__ for f in functions] == ["exact_match", "chrf", "exact_match_2", "starts_x"]
    assert weights == [2.0, 0.25, 1.0, 1.0]
    arguments = objective.arguments({"output_dir": str(tmp_path / "out"), "use_cpu": True, "report_to": []}, config)
    # TRL's total reward is the weighted sum: these weights, these functions, in this order
    assert arguments.reward_weights == [2.0, 0.25, 1.0, 1.0]
    assert (arguments.num_generations, arguments.max_completion_length, arguments.beta) == (8, 20, 0.04)
    assert GrpoConfig(**arguments.grpo_settings) == config.grpo


@pytest.mark.parametrize(("override", "expected"), [
    ("grpo.rewards=[{name: regex}]", "reward regex needs pattern"),
    ("grpo.rewards=[{name: regex, pattern: '(unclosed'}]", "is not a regular expression"),
    ("grpo.rewards=[{name: bleu}]", "grpo.rewards.0.name"),
    ("grpo.rewards=[{name: reward_model}]", "reward reward_model needs model"),
    ("grpo.rewards=[{name: function, function: no_such_module.reward}]",
     "grpo.rewards.0.function: cannot import no_such_module.reward"),
    ("grpo.rewards=[{name: function, function: tests.unit.test_grpo.REPO}]", "is a PosixPath, not a function"),
    ("grpo.rewards=[]", "grpo.rewards"),
    ("train.batch_size=30", "train.batch_size: GRPO trains on groups of grpo.num_generations=8"),
])
def test_a_bad_reward_setting_is_one_line_naming_it(tmp_path: Path, override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as raised:
        grpo_config(tmp_path / "p.jsonl", override)
    message = str(raised.value)
    assert expected in message and "\n" not in message, message


def test_prompts_come_from_common_column_names_and_unfit_ones_are_quarantined(tmp_path: Path) -> None:
    good = prompt_records(40, seed=5)
    odd = [
        {"question": "Write 7 in words.", "solution": "seven"},                       # line 41: mapped columns
        {"prompt": [{"role": "user", "content": "Add 2 and 2."}], "answer": 4},       # line 42: a number answer
        {"prompt": "Say something kind."},                                            # line 43: no answer at all
        {"prompt": "   ", "answer": "x"},                                             # line 44
        {"prompt": [{"role": "assistant", "content": "hi"}], "answer": "x"},          # line 45
        {"prompt": "Spell 3.", "answer": ["three"]},                                  # line 46
        {"prompt": "Spell 4.", "answer": "  "},                                       # line 47
        {"answer": "five"},                                                           # line 48
    ]
    write_jsonl(tmp_path / "p.jsonl", good + odd)
    config = grpo_config(tmp_path / "p.jsonl", "validate.max_bad_fraction=0.5")
    ingested = stage("ingest", config)
    records = list(read_records(ingested.dir))
    assert (records[40]["prompt"], records[40]["answer"]) == ("Write 7 in words.", "seven")
    validated = stage("validate", config, ingested)
    found = {entry["line"]: (entry["code"], entry["field"])
             for entry in read_jsonl(validated.dir / "quarantine.jsonl")}
    assert found == {44: ("empty", "prompt"), 45: ("chat_order", "prompt"), 46: ("wrong_type", "answer"),
                     47: ("empty", "answer"), 48: ("missing_field", "prompt")}
    deduped = stage("dedup", config, validated)
    kept = [row for split in ("train", "eval") for row in table_rows(deduped.dir / split)]
    by_prompt = {str(row["prompt"]): row.get("answer") for row in kept}
    assert by_prompt["[{'role': 'user', 'content': 'Add 2 and 2.'}]"] == "4"
    assert by_prompt["Say something kind."] is None


def test_a_numeric_answer_is_written_as_people_write_it() -> None:
    values = [4, 100000.0, 1e5, -0.0, 2.5, -12.0, 2.0**60, 1e300, True, None, "7.0", ["7"]]
    assert [answer_text(value) for value in values] == [
        "4", "100000", "100000", "0", "2.5", "-12", "1.152921504606847e+18", "1e+300", None, None, "7.0", None]


def test_a_prompt_is_encoded_as_evaluation_asks_an_sft_model(tmp_path: Path) -> None:
    """The rendered prompt is the chat template with the assistant's turn opened, and its tokens are the prefix of
    the SFT-encoded instruction with its answer."""
    rows = instruction_records(60, seed=3)
    write_jsonl(tmp_path / "i.jsonl", rows)
    sft, grpo = selected(DataConfig(kind="instruction")), selected(DataConfig(kind="prompts"))
    tokenizer = sft.train_tokenizer(training_texts(read_jsonl(tmp_path / "i.jsonl"), sft), 300)
    prepare_tokenizer(tokenizer, None, trained_here=True)
    prompts = [{"prompt": f"{r['instruction']}\n\n{r['input']}", "answer": r["output"]} for r in rows[:5]]
    encoded = grpo.encode(tokenizer, prompts + [{"prompt": "x " * 80}], Encoding(48))
    instructions = sft.encode(tokenizer, rows[:5], Encoding(48))
    for index, row in enumerate(rows[:5]):
        rendered = render(tokenizer, [{"role": "user", "content": prompts[index]["prompt"]}], generation_prompt=True)
        assert encoded["prompt"][index] == rendered and rendered.endswith("<|assistant|>\n")
        ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        assert instructions["input_ids"][index][:len(ids)] == ids and encoded["length"][index] == len(ids)
        assert encoded["answer"][index] == row["output"]
    # a prompt leaving no room for a completion is not trained on
    assert encoded["has_target"] == [True] * 5 + [False]
