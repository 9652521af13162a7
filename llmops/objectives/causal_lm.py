"""Causal language modelling: a decoder learns plain text, every token; scored on held-out loss and perplexity."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llmops.config.schema import PipelineConfig
from llmops.objectives.base import Encoding, Objective, ScoringContext
from llmops.objectives.language import LanguageModel, token_losses
from llmops.objectives.metrics import LOSS, PERPLEXITY, Scored, likelihood_parts, table
from llmops.records.base import TEXT
from llmops.text.encoding import token_ids, truncated

if TYPE_CHECKING:
    from llmops.objectives.base import Model, Tokenizer


class CausalLM(LanguageModel):
    name = "causal_lm"
    kinds = (TEXT,)
    summary = "causal language modelling (loss on every token)"
    metrics = table(LOSS, PERPLEXITY)
    # it has no chat format of its own: its card loads the components
    usage = Objective.usage
    serving_body = Objective.serving_body

    def flavor_settings(self, max_new_tokens: int) -> dict[str, Any]:
        """Plain text in, its greedy continuation (without the prompt) out."""
        return {"task": self.task, "model_config": {"max_new_tokens": max_new_tokens, "do_sample": False,
                                                    "return_full_text": False}}

    def encode(self, tokenizer: Tokenizer, rows: list[dict[str, Any]], encoding: Encoding) -> dict[str, list[Any]]:
        """Each text with the end-of-sequence token appended; every token is a target."""
        ids, end = token_ids(tokenizer, [row["text"] for row in rows]), tokenizer.eos_token_id
        for seq in ids:  # lists of this call's own
            seq.append(end)
        # every token is its own label: the labels are the very lists of ids (nothing changes them later), which
        # the stage then converts once
        return truncated(ids, ids, encoding.max_length)

    def default_primary(self, rows: list[dict[str, Any]]) -> tuple[str, str]:
        return "perplexity", "plain text: how well the model predicts held-out text"

    def score(self, model: Model, tokenizer: Tokenizer, rows: list[dict[str, Any]], context: ScoringContext) -> Scored:
        encoded = self.encode(tokenizer, rows, context.encoding) if rows else {"input_ids": [], "labels": []}
        nll, tokens = token_losses(model, encoded, tokenizer.pad_token_id, context.settings.batch_size)
        return Scored(likelihood_parts(nll, tokens, ""), [], self.metrics)

    def limitations(self, config: PipelineConfig, metrics: dict[str, float]) -> list[str]:
        return ["Perplexities compare only models that share a tokenizer."]
