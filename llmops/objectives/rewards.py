"""GRPO's rewards, by name: what `grpo.rewards` may list, each a function TRL's GRPOTrainer calls.

Every reward is called as TRL calls one, `f(prompts=..., completions=..., answer=..., **columns)`, and
gives one float per completion, or None where it has nothing to judge (a record without an answer):
TRL leaves those out of the reward's mean and of the total. The total is the weighted sum of the
rewards (TRL's reward_weights, `weight` of each entry); TRL logs each reward's mean and spread per
step. The rewards against the record's `answer` lie in 0-1: exact match (surrounding whitespace
aside, as held-out exact match counts), normalised numeric match, ROUGE-L, chrF / 100.
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from llmops.config.grpo import GrpoConfig, RewardConfig
from llmops.io.errors import ConfigError
from llmops.objectives.metrics import chrf_scores, exact_matches, rouge_l

if TYPE_CHECKING:
    from llmops.objectives.base import Model, Tokenizer

Reward = Callable[..., list[float | None]]
# a number as people write it: a sign, thousands separators, a decimal part
NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:[,_ ]\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")


def against_answer(score: Callable[[list[str], list[str]], list[float]]) -> Callable[..., list[float | None]]:
    """A reward scoring each completion against its record's answer; None where the record has none."""
    def reward(completions: list[str], answer: Sequence[str | None] | None = None, **_: Any) -> list[float | None]:
        answers = list(answer) if answer is not None else [None] * len(completions)
        scored = [i for i, reference in enumerate(answers) if reference is not None]
        values = score([completions[i] for i in scored], [str(answers[i]) for i in scored]) if scored else []
        out: list[float | None] = [None] * len(completions)
        for index, value in zip(scored, values, strict=True):
            out[index] = float(value)
        return out

    return reward


def parse_number(text: str) -> float | None:
    """The last number written in the text, separators removed; None when there is none."""
    found = NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(re.sub(r"[,_ ]", "", found[-1]))
    except ValueError:
        return None


def numeric_matches(predictions: list[str], references: list[str]) -> list[float]:
    """1 where the completion's last number equals the answer's (relative tolerance 1e-9), else 0."""
    scores = []
    for prediction, reference in zip(predictions, references, strict=True):
        got, expected = parse_number(prediction), parse_number(reference)
        same = got is not None and expected is not None and abs(got - expected) <= 1e-9 * max(1.0, abs(expected))
        scores.append(float(same))
    return scores


def rouge_l_scores(predictions: list[str], references: list[str]) -> list[float]:
    return [rouge_l(p, r) for p, r in zip(predictions, references, strict=True)]


def chrf_unit(predictions: list[str], references: list[str]) -> list[float]:
    """chrF on the 0-1 scale of the other rewards."""
    return [score / 100 for score in chrf_scores(predictions, references)]


def regex_reward(pattern: str) -> Reward:
    """1 where the pattern is found in the completion, else 0: a format check."""
    compiled = re.compile(pattern)

    def reward(completions: list[str], **_: Any) -> list[float | None]:
        return [float(compiled.search(text) is not None) for text in completions]

    return reward


def imported_function(path: str, where: str) -> Reward:
    """The function at a dotted path (package.module.function, or module:function)."""
    module, _, name = path.rpartition(":") if ":" in path else path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError, TypeError) as err:
        raise ConfigError(f"{where}: cannot import {path} ({type(err).__name__}: {err})") from None
    if not callable(found):
        raise ConfigError(f"{where}: {path} is a {type(found).__name__}, not a function")
    return found


class ModelReward:
    """A reward model (a sequence classifier with one output, objectives/reward.py) scoring each completion as the
    answer to its prompt's turns, as `llmops predict` scores a {"prompt", "response"} row. Loaded on first use."""

    def __init__(self, folder: str, where: str) -> None:
        self.folder, self.where = folder, where
        self.loaded: tuple[Model, Tokenizer] | None = None

    def load(self) -> tuple[Model, Tokenizer]:
        from llmops.objectives import reward

        if self.loaded is None:
            try:
                self.loaded = reward.load(self.folder)
            except (OSError, ValueError) as err:
                first = (str(err).strip().splitlines() or [type(err).__name__])[0]
                raise ConfigError(f"{self.where}: cannot load a reward model from {self.folder} ({first[:300]})") \
                    from None
        return self.loaded

    def __call__(self, completions: list[str], turns: Sequence[str] | None = None, **_: Any) -> list[float | None]:
        """Each completion's score; an empty completion, which the model cannot read, gets the batch's lowest."""
        from llmops.objectives import reward

        model, tokenizer = self.load()
        prompts = [json.loads(text) for text in turns] if turns is not None else [""] * len(completions)
        scored = [i for i, text in enumerate(completions) if text.strip()]
        rows = [{"prompt": prompts[i], "response": completions[i]} for i in scored]
        values = reward.scores_of(model, tokenizer, rows, batch_size=max(len(rows), 1)) if rows else []
        out: list[float | None] = [min(values, default=0.0)] * len(completions)
        for index, value in zip(scored, values, strict=True):
            out[index] = float(value)
        return out


BY_ANSWER: dict[str, Callable[[list[str], list[str]], list[float]]] = {
    "exact_match": exact_matches, "numeric_match": numeric_matches, "rouge_l": rouge_l_scores, "chrf": chrf_unit}


def reward_function(reward: RewardConfig, where: str) -> Reward:
    """The function one entry of the reward table names."""
    if reward.name in BY_ANSWER:
        return against_answer(BY_ANSWER[reward.name])
    if reward.name == "regex":
        assert reward.pattern is not None  # the config checks it
        return regex_reward(reward.pattern)
    if reward.name == "reward_model":
        assert reward.model is not None
        return ModelReward(reward.model, f"{where}.model")
    assert reward.function is not None
    return imported_function(reward.function, f"{where}.function")


def labels(rewards: list[RewardConfig]) -> list[str]:
    """Each reward's name in the logged figures: its label, else its name, numbered from the second of a name on."""
    seen: dict[str, int] = {}
    out = []
    for reward in rewards:
        base = reward.label or reward.name
        seen[base] = seen.get(base, 0) + 1
        out.append(base if seen[base] == 1 else f"{base}_{seen[base]}")
    if len(set(out)) != len(out):
        raise ConfigError("grpo.rewards: two rewards have the same label; give each its own")
    return out


def build(config: GrpoConfig) -> tuple[list[Reward], list[float]]:
    """The configured rewards as named functions (TRL logs each under its name), and their weights."""
    functions = []
    for index, (reward, label) in enumerate(zip(config.rewards, labels(config.rewards), strict=True)):
        functions.append(named(reward_function(reward, f"grpo.rewards.{index}"), label))
    return functions, [reward.weight for reward in config.rewards]


def named(function: Reward, label: str) -> Reward:
    """The function under the name TRL logs it by (a wrapper: a user's function is left as it is)."""
    def reward(**batch: Any) -> list[float | None]:
        return list(function(**batch))

    reward.__name__ = reward.__qualname__ = label
    return reward

