"""The `grpo` section: GRPO's sampling, its hold to the starting model, and the rewards that score completions.
Only objective grpo may set it (objectives/config.py).

The reward table (what each `name` computes) is objectives/rewards.py; here is only its shape, checked
when the config is read so that a bad reward is one line naming its field.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from llmops.config.section import Section

RewardName = Literal["exact_match", "numeric_match", "rouge_l", "chrf", "regex", "reward_model", "function"]
# the setting each reward needs besides its name (the others' settings are not read)
NEEDS = {"regex": "pattern", "reward_model": "model", "function": "function"}


class RewardConfig(Section):
    # which reward: exact_match, numeric_match, rouge_l, chrf (against the record's `answer`, 0-1), regex (1 when the
    # completion matches `pattern`), reward_model (the score of `model`), function (your own, at `function`)
    name: RewardName
    # its share of the total reward: the total is the weighted sum of every reward (TRL's reward_weights)
    weight: float = 1.0
    # regex: a Python regular expression searched in the completion (anchor it with ^...$ for the whole answer)
    pattern: str | None = None
    # reward_model: a folder, a hub id or a registered version (models:/NAME@alias) of a sequence classifier with one
    # output, scoring the prompt and the completion together
    model: str | None = None
    # function: the dotted path of a Python function (package.module.function) called as TRL calls a reward:
    # f(prompts=..., completions=..., answer=..., **columns) -> one float (or None) per completion
    function: str | None = None
    # a name for the reward's figures (train/rewards/<label>/mean); None: its name, numbered when repeated
    label: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")

    @model_validator(mode="after")
    def settings_fit_the_reward(self) -> RewardConfig:
        needed = NEEDS.get(self.name)
        if needed is not None and not getattr(self, needed):
            raise ValueError(f"reward {self.name} needs {needed}")
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as err:
                raise ValueError(f"pattern {self.pattern!r} is not a regular expression ({err})") from None
        return self


class GrpoConfig(Section):
    """Objective grpo (kind prompts): train.batch_size counts completions, num_generations of them per prompt."""

    rewards: list[RewardConfig] = Field(default_factory=lambda: [RewardConfig(name="exact_match")], min_length=1)
    # completions sampled per prompt: their rewards are compared within the group
    num_generations: int = Field(4, ge=2)
    # tokens a completion may have; keep it short on CPU
    max_completion_length: int = Field(16, ge=1)
    temperature: float = Field(1.0, gt=0)
    # the KL penalty to the starting model (0: none, and no reference model is kept)
    beta: float = Field(0.04, ge=0)
    # policy updates per batch of completions (TRL's num_iterations)
    iterations: int = Field(1, ge=1)
