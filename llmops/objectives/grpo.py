"""GRPO on prompts with verifiable rewards: TRL's GRPOTrainer sampling completions and rewarding them.

Each prompt is rendered through the chat template with the assistant's turn opened, exactly as SFT's
evaluation asks a model (objectives/language.py:generate), so a model fine-tuned by SFT answers in
the format it learned. For every prompt GRPOTrainer samples `grpo.num_generations`
completions of at most `max_completion_length` tokens, scores each with the configured rewards
(objectives/rewards.py: exact match, numeric match, ROUGE-L, chrF against the record's answer, a
regex, a reward model, a function of yours; their weighted sum is the total) and moves the policy
toward the completions that beat their group's mean, held to the starting model by a KL penalty
(`beta`). Per step it logs each reward's mean and spread, the completion length and the KL, as
`train/rewards/<reward>/mean`, `train/rewards/<reward>/std`, `train/completions/mean_length`,
`train/kl`. Held out, it is scored as SFT is: greedy answers against each record's answer (exact
match, ROUGE-L, chrF) and the likelihood of the answer; rows without an answer count in none of these.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llmops.config.grpo import GrpoConfig
from llmops.config.schema import ModelConfig, PipelineConfig
from llmops.io.files import load_dataset_dir
from llmops.models import modeling
from llmops.objectives.base import Encoding, Request, RowError, ScoringContext, Served, generation_limitations
from llmops.objectives.language import LanguageModel, generate, token_losses
from llmops.objectives.metrics import GENERATIVE, Scored, by_answer_length, generation_parts, likelihood_parts
from llmops.objectives.rewards import build
from llmops.objectives.sft import encode_conversations
from llmops.records.base import Problem
from llmops.records.preference import turns_ok
from llmops.records.prompts import PROMPTS, answer_text, messages
from llmops.records.turns import conversation
from llmops.text import packing
from llmops.text.templates import render

if TYPE_CHECKING:
    import pyarrow as pa
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    from llmops.objectives.base import Model, Tokenizer

# what the trainer reads of a tokenized row: the rendered prompt, the prompt's turns as JSON (for a reward model)
# and the answer (for the rewards against it)
COLUMNS = ("prompt", "turns", "answer")


class GRPO(LanguageModel):
    name = "grpo"
    section = "grpo"
    kinds = (PROMPTS,)
    summary = "reinforcement learning (GRPO) on prompts, rewarded by verifiable rewards"
    metrics = GENERATIVE
    packable = False
    needs_base = True
    # the loss starts near zero (no KL yet, advantages centred) and grows with the KL term
    loss_falls = False

    def check(self, config: PipelineConfig) -> list[Problem]:
        problems = super().check(config)
        settings, batch = config.grpo, config.train.batch_size
        if batch % settings.num_generations:
            problems.append(("train.batch_size", f"GRPO trains on groups of grpo.num_generations="
                             f"{settings.num_generations} completions per prompt: set train.batch_size to a multiple "
                             f"of it (got {batch})"))
        for index, reward in enumerate(settings.rewards):
            if reward.name == "function":  # a reward model loads when training starts; a function is found now
                try:
                    build(settings.model_copy(update={"rewards": [reward]}))
                except ValueError as err:
                    problems.append((f"grpo.rewards.{index}.function", str(err).partition(": ")[2]))
        return problems

    # --- tokenize ------------------------------------------------------------------------------------------

    def encode(self, tokenizer: Tokenizer, rows: list[dict[str, Any]], encoding: Encoding) -> dict[str, list[Any]]:
        """Each prompt rendered with the assistant's turn opened, as evaluation generates from it; a prompt that
        leaves no room for a completion within max_length is not trained on."""
        texts = [render(tokenizer, messages(row), generation_prompt=True) for row in rows]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if rows else []
        answers = [answer_text(row.get("answer")) for row in rows]
        answer_ids = tokenizer([a or "" for a in answers], add_special_tokens=False)["input_ids"] if rows else []
        return {"prompt": texts, "turns": [json.dumps(messages(row)) for row in rows], "answer": answers,
                "raw_length": [len(seq) for seq in ids], "length": [min(len(seq), encoding.max_length) for seq in ids],
                "has_target": [len(seq) < encoding.max_length for seq in ids],
                "target_tokens": [len(seq) for seq in answer_ids]}

    def arrow_schema(self) -> pa.Schema:
        import pyarrow as pa

        return pa.schema([("prompt", pa.string()), ("turns", pa.string()), ("answer", pa.string()),
                          ("raw_length", pa.int32()), ("length", pa.int32())])

    # --- train ---------------------------------------------------------------------------------------------

    def with_adapter(self, model: Model, model_config: ModelConfig, gradient_checkpointing: bool) -> Model:
        return model  # GRPOTrainer adds the adapter, so that its reference is the adapter switched off

    def datasets(self, tokenized_dir: Path, packed: bool, max_length: int) -> tuple[Dataset, Dataset]:
        """Training prompts with their sample ids (for the ledger); held-out prompts as they are."""
        train_set = packing.with_sample_ids(load_dataset_dir(tokenized_dir / "train"), per_token=False)
        eval_set = load_dataset_dir(tokenized_dir / "eval").select_columns(list(COLUMNS))
        return train_set.select_columns([*COLUMNS, packing.SAMPLE_IDS]), eval_set

    def meter(self, tokenizer: Tokenizer, model: Model, packed: bool, max_length: int, seed: int) -> packing.BatchMeter:
        return PromptMeter(None)

    def arguments(self, common: dict[str, Any], config: PipelineConfig) -> TrainingArguments:
        from trl import GRPOConfig

        settings = config.grpo
        arguments = GRPOConfig(**common, beta=settings.beta, num_generations=settings.num_generations,
                          max_completion_length=settings.max_completion_length, temperature=settings.temperature,
                          num_iterations=settings.iterations, reward_weights=[r.weight for r in settings.rewards],
                          # the rollouts of one optimizer step are generated together
                          steps_per_generation=config.train.grad_accum, disable_dropout=True, log_completions=False)
        # the section the trainer builds the rewards from (plain data: the arguments are pickled into checkpoints)
        arguments.grpo_settings = settings.model_dump(mode="json")
        return arguments

    def trainer(self, model: Model, settings: dict[str, Any], model_config: ModelConfig, tokenizer: Tokenizer,
                seed: int) -> Trainer:
        """TRL's GRPOTrainer on the rendered prompts, with the configured rewards and weights. With an adapter the
        reference is the model with the adapter off; for full fine-tuning, a frozen copy of the starting model."""
        from trl import GRPOTrainer

        class RenderedPromptsGRPOTrainer(GRPOTrainer):
            """The prompts arrive rendered by the tokenize stage through the chat template: they are tokenized as
            evaluation tokenizes them, without special tokens added a second time."""

            def _tokenize_prompts(self, prompts: list[str]) -> tuple[list[list[int]], None, dict[str, Any]]:
                return self.processing_class(text=prompts, add_special_tokens=False)["input_ids"], None, {}

        functions, _ = build(GrpoConfig(**settings["args"].grpo_settings))
        meter = settings.pop("data_collator")
        lora = modeling.lora_settings(model_config.lora, self.peft_task) if model_config.adapter != "none" else None
        model.config.use_cache = True  # GRPO decodes every step
        trainer = RenderedPromptsGRPOTrainer(model=model, reward_funcs=functions, peft_config=lora, **settings)
        trainer.data_collator = meter  # identity, as GRPOTrainer's own, recording each batch's sample ids
        return trainer

    # --- evaluate ------------------------------------------------------------------------------------------

    def references(self, rows: list[dict[str, Any]]) -> list[str | None]:
        return [answer_text(row.get("answer")) for row in rows]

    def default_primary(self, rows: list[dict[str, Any]]) -> tuple[str, str]:
        return by_answer_length([answer for answer in self.references(rows) if answer is not None])

    def score(self, model: Model, tokenizer: Tokenizer, rows: list[dict[str, Any]], context: ScoringContext) -> Scored:
        """Greedy answers to every prompt; the metrics against the answer count the rows that have one."""
        settings, references = context.settings, self.references(rows)
        answered = np.array([reference is not None for reference in references], dtype=float)[:, None]
        conversations = [conversation(row["prompt"], reference or "")
                         for row, reference in zip(rows, references, strict=True)]
        encoded = encode_conversations(tokenizer, conversations, context.encoding.max_length) if rows \
            else {"input_ids": [], "labels": []}
        nll, tokens = token_losses(model, encoded, tokenizer.pad_token_id, settings.batch_size)
        texts, lengths, cut = generate(model, tokenizer, [messages(row) for row in rows], settings.max_new_tokens,
                                       settings.batch_size)
        parts = {**likelihood_parts(nll, tokens, "completion_"),
                 **generation_parts(texts, [reference or "" for reference in references], lengths, cut)}
        for name in ("completion_loss", "completion_perplexity", "exact_match", "rouge_l", "chrf"):
            parts[name] = parts[name] * answered if len(rows) else parts[name]
        return Scored(parts, texts, self.metrics)

    def limitations(self, config: PipelineConfig, metrics: dict[str, float]) -> list[str]:
        return generation_limitations(config, metrics) + [
            "Trained to please its rewards: answers are as right as the rewards can tell."]

    # --- predict -------------------------------------------------------------------------------------------

    def request(self, line: int, row: dict[str, Any], served: Served) -> Request:
        """A prompts row ({"prompt", "answer"}) is answered as evaluation answers it; other rows as any chat model."""
        if "prompt" not in row:
            return super().request(line, row, served)
        prompt = row["prompt"]
        if not (isinstance(prompt, str) and prompt.strip()) and not (isinstance(prompt, list) and turns_ok(prompt)):
            raise RowError("prompt: expected non-empty text or a list of {role, content} turns")
        return Request(line, "generate", {"prompt": messages(row)}, answer_text(row.get("answer")))


class PromptMeter(packing.BatchMeter):
    """GRPO's collator is the identity (rows go to generation as they are, each with its sample id): the training
    process reads a drawn batch's prompts' sample ids from its rows, once per prompt however many completions it
    gets, for the ledger."""

    def __call__(self, examples: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return examples

    def figures_of(self, batch: Any) -> packing.BatchFigures:
        ids = [sample for example in batch for sample in packing.samples_in(example)]
        return packing.BatchFigures(samples=tuple(dict.fromkeys(ids)))
