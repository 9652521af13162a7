"""Reward models: pairs encoded as SFT renders them, pairwise accuracy and margins against hand-computed values, one
score per sequence whatever its batch, prediction rows and their errors, and the scorer a later stage calls on a
model folder (training, registering and serving a reward model end to end: tests/integration/test_reward_e2e.py)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llmops.config.schema import DataConfig, EvaluateConfig, ModelConfig
from llmops.data.synthetic import preference_records
from llmops.io.errors import ConfigError
from llmops.objectives import load_config, selected
from llmops.objectives.base import Encoding, RowError, ScoringContext, Served
from llmops.objectives.metrics import Scored
from llmops.objectives.reward import METRICS, RewardModel, pair_parts, score, scores_of, sequence_scores
from llmops.text.encoding import IGNORE_INDEX
from llmops.text.tokenizers import prepare_tokenizer, train_bpe

REPO = Path(__file__).resolve().parents[2]
PAIRS = preference_records(40, seed=5)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    made = train_bpe((f"{row['prompt']}\n{row['chosen']}\n{row['rejected']}" for row in PAIRS), 300)
    prepare_tokenizer(made, None, trained_here=True)
    return made


@pytest.fixture(scope="module")
def objective() -> RewardModel:
    found = selected(DataConfig(kind="preference", objective="reward"))
    assert isinstance(found, RewardModel)
    return found


@pytest.fixture(scope="module")
def model(tokenizer: Any, objective: RewardModel) -> Any:
    """A small random reward model: one output, read at each sequence's last token."""
    built = objective.build_model(ModelConfig(architecture="llama", hidden_size=32, num_layers=1, num_heads=2),
                                  tokenizer, seed=3, labels=[])
    assert built.config.num_labels == 1 and built.config.pad_token_id == tokenizer.pad_token_id
    return built.eval()


def served(model: Any, tokenizer: Any, max_length: int = 48) -> Served:
    return Served(model=model, tokenizer=tokenizer, labels=None, encoding=Encoding(max_length), max_new_tokens=8)


def test_pairwise_accuracy_margin_and_loss_are_the_hand_computed_values() -> None:
    # differences 1, 0, -2, 1: a tie is a miss
    parts = pair_parts([2.0, 0.5, 1.0, -1.0], [1.0, 0.5, 3.0, -2.0])
    values = Scored(parts, [], METRICS).values()
    assert values["pairwise_accuracy"] == 0.5
    assert values["score_margin"] == 0.0
    expected_loss = (2 * math.log(1 + math.exp(-1)) + math.log(2) + math.log(1 + math.exp(2))) / 4
    assert values["pair_loss"] == pytest.approx(expected_loss, abs=1e-12)
    assert parts["pairwise_accuracy"].tolist() == [[1, 1], [0, 1], [0, 1], [1, 1]]
    assert pair_parts([], [])["pairwise_accuracy"].shape == (0, 2)


def test_a_pair_is_rendered_as_sft_renders_it_and_long_ones_keep_their_end(tokenizer: Any,
                                                                           objective: RewardModel) -> None:
    sft = selected(DataConfig(kind="instruction"))
    rows = PAIRS[:4]
    instructions = [{"instruction": row["prompt"], "input": "", "output": row["chosen"]} for row in rows]
    rendered = sft.encode(tokenizer, instructions, Encoding(128))
    encoded = objective.encode(tokenizer, rows, Encoding(128))
    for index, row in enumerate(rows):
        labels = rendered["labels"][index]
        last = max(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
        # the prompt and the answer through its end-of-turn marker, as SFT trains on them
        assert encoded["chosen_ids"][index] == rendered["input_ids"][index][:last + 1]
        assert tokenizer.decode(encoded["rejected_ids"][index]).endswith(f"{row['rejected']}<|end|>")
    assert encoded["has_target"] == [True] * 4 and encoded["target_tokens"] == [2] * 4
    short = objective.encode(tokenizer, rows[:1], Encoding(6))
    assert short["chosen_ids"][0] == encoded["chosen_ids"][0][-6:]
    assert short["length"] == [6] and short["raw_length"][0] == max(len(encoded["chosen_ids"][0]),
                                                                     len(encoded["rejected_ids"][0]))


def test_a_score_does_not_depend_on_the_batch_it_is_read_in(tokenizer: Any, objective: RewardModel,
                                                           model: Any) -> None:
    encoded = objective.encode(tokenizer, PAIRS[:6], Encoding(48))
    sequences = [*encoded["chosen_ids"], *encoded["rejected_ids"]]
    alone = [sequence_scores(model, [ids], tokenizer.pad_token_id, 1)[0] for ids in sequences]
    batched = sequence_scores(model, sequences, tokenizer.pad_token_id, 5)
    assert np.allclose(alone, batched, atol=1e-5)
    assert len(set(np.round(alone, 6))) > 1  # the scores differ: a real head on real sequences

    scored = objective.score(model, tokenizer, PAIRS[:6], ScoringContext(EvaluateConfig(batch_size=4),
                                                                         Encoding(48)))
    differences = np.array(batched[:6]) - np.array(batched[6:])
    assert np.allclose(scored.parts["score_margin"][:, 0], differences, atol=1e-5)
    assert scored.values()["pairwise_accuracy"] == pytest.approx(float(np.mean(differences > 0)))
    assert scored.outputs == ["chosen" if d > 0 else "rejected" for d in differences]


def test_prediction_rows_are_scored_or_compared_as_evaluation_reads_them(tokenizer: Any, objective: RewardModel,
                                                                        model: Any) -> None:
    version = served(model, tokenizer)
    pair = PAIRS[0]
    rows = [{"prompt": pair["prompt"], "response": pair["chosen"]},
            {"prompt": [{"role": "user", "content": pair["prompt"]}],
             "response": [{"role": "assistant", "content": pair["rejected"]}]},
            {"prompt": pair["prompt"], "chosen": pair["chosen"], "rejected": pair["rejected"]}]
    requests = [objective.request(line, row, version) for line, row in enumerate(rows, 1)]
    assert [request.ask for request in requests] == ["score", "score", "compare"]
    answers = objective.answer(version, requests)
    chosen, rejected = answers[0]["score"], answers[1]["score"]
    assert answers[2]["chosen_score"] == pytest.approx(chosen, abs=1e-5)
    assert answers[2]["rejected_score"] == pytest.approx(rejected, abs=1e-5)
    assert answers[2]["preferred"] == ("chosen" if chosen > rejected else "rejected")
    assert not answers[0]["truncated"] and not answers[2]["truncated"]
    encoded = objective.encode(tokenizer, [pair], Encoding(48))
    assert sequence_scores(model, encoded["chosen_ids"], tokenizer.pad_token_id, 1)[0] == pytest.approx(chosen,
                                                                                                       abs=1e-5)
    cut = objective.answer(served(model, tokenizer, max_length=8), requests[:1])[0]
    assert cut["truncated"] and cut["score"] != pytest.approx(chosen, abs=1e-6)


@pytest.mark.parametrize(("row", "message"), [
    ({"text": "hello"}, "expected fields prompt and response (or prompt, chosen and rejected); got text"),
    ({}, "expected fields prompt and response (or prompt, chosen and rejected); got an empty object"),
    ({"prompt": "Spell 4."}, "expected fields prompt and response (or prompt, chosen and rejected); got prompt"),
    ({"prompt": "  ", "response": "four"}, "prompt: empty or only whitespace"),
    ({"prompt": 4, "response": "four"}, "prompt: expected text or a non-empty list of {role, content} turns, got int"),
    ({"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "response": "x"},
     "prompt: the last turn must be the user's (the response answers it)"),
    ({"prompt": [{"role": "robot", "content": "hi"}], "response": "x"},
     "prompt: turn 1 is not a {role: system|user|assistant, content: string}"),
    ({"prompt": "Spell 4.", "response": ""}, "response: empty or only whitespace"),
    ({"prompt": "Spell 4.", "response": 4}, "response: expected text or one assistant turn, got int"),
    ({"prompt": "Spell 4.", "chosen": "four"}, "rejected: expected text or one assistant turn, got nothing"),
])
def test_a_row_that_cannot_be_scored_says_why(objective: RewardModel, tokenizer: Any, row: dict[str, Any],
                                              message: str) -> None:
    with pytest.raises(RowError) as raised:
        objective.request(1, row, served(None, tokenizer))
    assert str(raised.value) == message


def test_a_later_stage_scores_rows_with_a_saved_model_folder(tokenizer: Any, objective: RewardModel, model: Any,
                                                            tmp_path: Path) -> None:
    """`score(model_dir, rows)`: the folder a train stage saves, or an exported version, scores as predict does."""
    model.save_pretrained(str(tmp_path / "model"))
    tokenizer.save_pretrained(str(tmp_path / "model"))
    rows = [{"prompt": pair["prompt"], "response": pair[side]} for pair in PAIRS[:3] for side in ("chosen", "rejected")]
    found = score(tmp_path / "model", rows, max_length=48, batch_size=4)
    version = served(model, tokenizer)
    answers = objective.answer(version, [objective.request(i, row, version) for i, row in enumerate(rows, 1)])
    assert np.allclose(found, [answer["score"] for answer in answers], atol=1e-5)
    assert scores_of(model, tokenizer, []) == []
    with pytest.raises(RowError, match="response: empty"):
        scores_of(model, tokenizer, [{"prompt": "Spell 4.", "response": " "}])


def test_the_tiny_config_trains_a_reward_model_from_scratch_and_margin_decides_nothing() -> None:
    config = load_config(REPO / "configs" / "tiny_reward_cpu.yaml")
    assert config.data.objective == "reward" and config.model.architecture == "llama"
    assert selected(config.data).default_primary([])[0] == "pairwise_accuracy"
    with pytest.raises(ConfigError, match="evaluate.primary_metric: score_margin has no better direction"):
        load_config(REPO / "configs" / "tiny_reward_cpu.yaml", ["evaluate.primary_metric=score_margin"])
    assert selected(config.data).peft_task == "SEQ_CLS"  # a LoRA adapter on a pretrained base trains the head whole


def test_a_pretrained_decoder_gets_a_lora_adapter_and_a_whole_score_head(tokenizer: Any, objective: RewardModel,
                                                                         tmp_path: Path) -> None:
    """A causal LM checkpoint becomes a one-output classifier; LoRA (task SEQ_CLS) trains beside the whole head, and
    the saved adapter loads back on its base (whose config names no pad token) scoring as before."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    base = tmp_path / "base"
    AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        eos_token_id=tokenizer.eos_token_id)).save_pretrained(str(base))
    tokenizer.save_pretrained(str(base))
    settings = ModelConfig(name_or_path=str(base), adapter="lora")
    model = objective.with_adapter(objective.build_model(settings, tokenizer, seed=1, labels=[]), settings, False)
    trained = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    assert any("lora_" in name for name in trained) and any("score" in name and "lora_" not in name
                                                             for name in trained)
    model.save_pretrained(str(tmp_path / "adapter"))
    tokenizer.save_pretrained(str(tmp_path / "adapter"))
    loaded = objective.load_trained(tmp_path / "adapter").eval()
    encoded = objective.encode(tokenizer, PAIRS[:3], Encoding(48))
    sequences = [*encoded["chosen_ids"], *encoded["rejected_ids"]]
    assert np.allclose(sequence_scores(loaded, sequences, tokenizer.pad_token_id, 6),
                       sequence_scores(model.eval(), sequences, tokenizer.pad_token_id, 6), atol=1e-5)
