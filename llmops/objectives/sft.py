"""Supervised fine-tuning on instructions and chats: loss on the assistant's tokens only (TRL's SFTTrainer).

Records are rendered with the tokenizer's chat template (or the configured one); labels are
IGNORE_INDEX everywhere except the assistant turns, end-of-turn marker included. Held out: the
loss and perplexity of the response tokens alone, and on greedy generations of the last assistant
turn exact match, ROUGE-L, chrF, the mean generated length and the share cut at max_new_tokens;
where held-out rows end with a tool call, whether the generated call names the right tool with the
right arguments (objectives/tool_answers.py), the primary metric when at least half of them do; generation
then has room for the longest held-out call, whatever evaluate.max_new_tokens says.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from llmops.config.schema import PipelineConfig
from llmops.objectives.base import Encoding, ScoringContext, generation_limitations
from llmops.objectives.language import LanguageModel, generate, token_losses
from llmops.objectives.metrics import GENERATIVE, Scored, by_answer_length, generation_parts, likelihood_parts, table
from llmops.objectives.sft_trainer import sft_trainer_class
from llmops.objectives.tool_answers import TOOL_METRICS, call_parts, reference_calls
from llmops.records.conversations import CHAT, INSTRUCTION, Conversational, prompt_and_reference
from llmops.text.encoding import last_span_length, response_labels, truncated
from llmops.text.templates import renderer_for

if TYPE_CHECKING:
    from transformers import Trainer, TrainingArguments

    from llmops.config.schema import ModelConfig
    from llmops.objectives.base import Model, Tokenizer

log = logging.getLogger("llmops.evaluate")
SUMMARIES = {"instruction": "supervised fine-tuning on instruction/response pairs (loss on the responses only)",
             "chat": "supervised fine-tuning on conversations (loss on every assistant turn)"}


class SFT(LanguageModel):
    name = "sft"
    needs_offsets = True
    kinds = (INSTRUCTION, CHAT)
    # tool-call accuracies are reported where held-out rows end with a call
    metrics = table(*GENERATIVE.values(), *TOOL_METRICS)

    @property
    def summary(self) -> str:  # type: ignore[override]
        return SUMMARIES[self.kind.name]

    def encode(self, tokenizer: Tokenizer, rows: list[dict[str, Any]], encoding: Encoding) -> dict[str, list[Any]]:
        """Conversations through the chat template; labels on the assistant spans, IGNORE_INDEX elsewhere."""
        return encode_conversations(tokenizer, [self.conversation(row) for row in rows], encoding.max_length,
                                    [self.tools(row) for row in rows])

    def conversation(self, row: dict[str, Any]) -> Any:
        kind = self.kind
        assert isinstance(kind, Conversational)
        return kind.conversation(row)

    def tools(self, row: dict[str, Any]) -> Any:
        kind = self.kind
        assert isinstance(kind, Conversational)
        return kind.tools(row)

    def arguments(self, common: dict[str, Any], config: PipelineConfig) -> TrainingArguments:
        from trl import SFTConfig

        # the rows come encoded (and packed or not) from the tokenize stage: TRL has nothing to prepare
        return SFTConfig(**common, max_length=None, packing=False, dataset_kwargs={"skip_prepare_dataset": True})

    def trainer(self, model: Model, settings: dict[str, Any], model_config: ModelConfig, tokenizer: Tokenizer,
                seed: int) -> Trainer:
        # TRL's SFTTrainer, its figures read at logging steps only (no host sync per step)
        return sft_trainer_class()(model=model, **settings)

    def references(self, rows: list[dict[str, Any]]) -> list[str]:
        return [prompt_and_reference(self.conversation(row))[1] for row in rows]

    def reference_calls(self, rows: list[dict[str, Any]]) -> list[Any]:
        """Per row, the calls its last assistant turn makes (None where it answers without one)."""
        return [reference_calls(self.conversation(row)[-1]) for row in rows]

    def default_primary(self, rows: list[dict[str, Any]]) -> tuple[str, str]:
        calls = sum(found is not None for found in self.reference_calls(rows))
        if calls and 2 * calls >= len(rows):
            return "tool_call_accuracy", (f"{calls} of {len(rows)} held-out rows end with a tool call: the right tool "
                                          "with the right arguments (equal as JSON values) is what counts")
        return by_answer_length(self.references(rows))

    def score(self, model: Model, tokenizer: Tokenizer, rows: list[dict[str, Any]], context: ScoringContext) -> Scored:
        encoded = self.encode(tokenizer, rows, context.encoding) if rows else {"input_ids": [], "labels": []}
        settings = context.settings
        nll, tokens = token_losses(model, encoded, tokenizer.pad_token_id, settings.batch_size)
        prompts = [prompt_and_reference(self.conversation(row))[0] for row in rows]
        calls = self.reference_calls(rows)
        room = generation_room(settings.max_new_tokens, encoded["labels"], calls)
        texts, lengths, cut = generate(model, tokenizer, prompts, room, settings.batch_size,
                                       [self.tools(row) for row in rows])
        parts = {**likelihood_parts(nll, tokens, "completion_"),
                 **generation_parts(texts, self.references(rows), lengths, cut)}
        if any(found is not None for found in calls):
            parts.update(call_parts(texts, calls))
        return Scored(parts, texts, self.metrics)

    def limitations(self, config: PipelineConfig, metrics: dict[str, float]) -> list[str]:
        return generation_limitations(config, metrics) + ["Perplexities compare only models that share a tokenizer."]


def generation_room(configured: int, labels: list[list[int]], calls: list[Any]) -> int:
    """evaluate.max_new_tokens, or more where a held-out call is longer: a call cut short parses as no call at all,
    so the longest reference call (in this tokenizer's tokens, end-of-turn marker included) is the least room a
    model is given to make it."""
    needed = max((last_span_length(row) for row, call in zip(labels, calls, strict=True) if call is not None),
                 default=0)
    if needed > configured:
        log.info("held-out tool calls take up to %d tokens: generating up to %d, not evaluate.max_new_tokens=%d",
                 needed, needed, configured)
    return max(configured, needed)


def encode_conversations(tokenizer: Tokenizer, conversations: list[Any], max_length: int,
                         tools: list[Any] | None = None) -> dict[str, list[Any]]:
    """Rendered conversations (with their tools, if any) as ids, labels on the assistant spans, tool calls included
    and tool results not (the Rust tokenizer's encodings answer the char -> token lookups without Python-side
    offsets)."""
    render = renderer_for(tokenizer)
    rendered = [render(messages, listed) for messages, listed in
                zip(conversations, tools or [None] * len(conversations), strict=True)]
    encodings = tokenizer.backend_tokenizer.encode_batch([text for text, _ in rendered], add_special_tokens=False)
    ids = [encoding.ids for encoding in encodings]
    labels = [response_labels(encoding, tokens, spans)
              for encoding, tokens, (_, spans) in zip(encodings, ids, rendered, strict=True)]
    return truncated(ids, labels, max_length)

