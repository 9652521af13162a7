"""KTO on unpaired feedback: encoding through the SFT chat template, TRL's KTOTrainer, and the held-out metrics.

Each feedback record (records/feedback.py) is a prompt, one completion and a label: desirable
or not. The prompt and the completion are rendered through the chat template exactly as SFT
renders an instruction and its response, the completion's tokens running through the end-of-turn
marker; the tokenize stage caches them and TRL's KTOTrainer trains on them, with a LoRA adapter by
default (its reference is the starting model, the adapter switched off) or against a frozen copy
of the starting model. KTO raises the implied reward, `preference.beta` times the
completion's log-ratio to the reference, of desirable completions above its reference point (the
KL estimated on mismatched completions: each prompt with another row's completion) and lowers
that of undesirable ones below it. Held out: how well the implied reward ranks desirable
completions above undesirable ones (`reward_auc`, the primary metric, 0.5 for the starting model
itself), KTO's reward margin and KL, and `likelihood_auc`, the same ranking by the completion's
own mean log-likelihood, which needs no reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llmops.config.schema import ModelConfig, PipelineConfig
from llmops.io.files import load_dataset_dir
from llmops.objectives.base import Encoding, ScoringContext
from llmops.objectives.dpo import DPO, Reference, split_answer
from llmops.objectives.encoded import PreEncoded
from llmops.objectives.language import LanguageModel, token_losses
from llmops.objectives.metrics import Metric, Scored, means, ratio, table
from llmops.records.base import Problem
from llmops.records.feedback import FEEDBACK
from llmops.records.turns import conversation
from llmops.text import packing
from llmops.text.encoding import IGNORE_INDEX, response_labels
from llmops.text.templates import renderer_for

if TYPE_CHECKING:
    import pyarrow as pa
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    from llmops.objectives.base import Model, Tokenizer

ID_COLUMNS = ("prompt_ids", "completion_ids")
# KTOTrainer reads the training rows in order (its KL term pairs each row with its neighbour's completion): they
# are shuffled once, by a fixed seed, so that a file sorted by label still gives batches of both labels
ORDER_SEED = 0


def mean_difference(sums: np.ndarray) -> np.ndarray:
    """Parts (value x desirable, desirable, value x undesirable, undesirable): the desirable rows' mean minus the
    undesirable rows'; NaN where a label has no row."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where((sums[:, 1] > 0) & (sums[:, 3] > 0), sums[:, 0] / sums[:, 1] - sums[:, 2] / sums[:, 3],
                        np.nan)


METRICS = table(
    Metric("reward_auc", ratio, True, "AUC of the implied reward (beta times the completion's log-ratio to the "
           "starting model) against the label: the chance that a desirable completion out-scores an undesirable one"),
    Metric("reward_margin", mean_difference, True, "mean implied reward of the desirable completions minus that of "
           "the undesirable ones (KTO's rewards/margins)"),
    Metric("likelihood_auc", ratio, True, "AUC of the completion's mean per-token log-likelihood against the label, "
           "with no reference: any two models compare on it"),
    Metric("kl", ratio, None, "KTO's reference point: the mean log-ratio to the starting model of mismatched "
           "completions (each prompt with the previous row's completion)"))
PRIMARY = ("reward_auc", "unpaired feedback: how well the model's change from its starting point ranks desirable "
                         "completions above undesirable ones (0.5: no better than the starting model)")


class KTO(LanguageModel):
    name = "kto"
    section = "preference"
    needs_offsets = True
    kinds = (FEEDBACK,)
    summary = "preference optimization (KTO) on unpaired feedback: completions labelled desirable or undesirable"
    metrics = METRICS
    packable = False
    needs_base = True
    measured_against_start = True
    # as DPO's: a LoRA adapter unless model.adapter says otherwise, added by the trainer (the reference is then the
    # base with the adapter off), and the reward measured against the starting model with beta
    defaults = DPO.defaults
    with_adapter = DPO.with_adapter
    reference = DPO.reference
    reference_and_lora = DPO.reference_and_lora

    def check(self, config: PipelineConfig) -> list[Problem]:
        problems = super().check(config)
        if config.train.batch_size < 2:
            problems.append(("train.batch_size", "KTO's KL term pairs each prompt with another row's completion in "
                             "the same batch: set train.batch_size to 2 or more"))
        return problems

    # --- tokenize ------------------------------------------------------------------------------------------

    def encode(self, tokenizer: Tokenizer, rows: list[dict[str, Any]], encoding: Encoding) -> dict[str, list[Any]]:
        """Prompt ids and the completion's ids (through the end-of-turn marker), rendered as SFT renders a response,
        and the label. The completion is cut so that prompt and completion fit `max_length`; a prompt that leaves
        no room has no target."""
        render = renderer_for(tokenizer)
        rendered = [render(conversation(row["prompt"], row["completion"])) for row in rows]
        encodings = tokenizer.backend_tokenizer.encode_batch([text for text, _ in rendered], add_special_tokens=False)
        batch: dict[str, list[Any]] = {name: [] for name in (*ID_COLUMNS, "label", "labels", "raw_length", "length",
                                                              "has_target")}
        for item, (_, spans), row in zip(encodings, rendered, rows, strict=True):
            prompt, completion = split_answer(item.ids, response_labels(item, item.ids, spans[-1:]))
            room = max(encoding.max_length - len(prompt), 0)
            batch["prompt_ids"].append(prompt)
            batch["completion_ids"].append(completion[:room])
            batch["label"].append(bool(row["label"]))
            batch["labels"].append(completion[:room])  # the tokens trained on, for the figures
            batch["raw_length"].append(len(prompt) + len(completion))
            batch["length"].append(min(batch["raw_length"][-1], encoding.max_length))
            batch["has_target"].append(room > 0 and bool(completion))
        return batch

    def arrow_schema(self) -> pa.Schema:
        import pyarrow as pa

        return pa.schema([(name, pa.list_(pa.int32())) for name in ID_COLUMNS] +
                         [("label", pa.bool_()), ("raw_length", pa.int32()), ("length", pa.int32())])

    # --- train ---------------------------------------------------------------------------------------------

    def datasets(self, tokenized_dir: Path, packed: bool, max_length: int) -> tuple[Dataset, Dataset]:
        """Training rows with their sample ids (for the ledger), shuffled once; held-out rows as they are."""
        columns = [*ID_COLUMNS, "label"]
        train_set = packing.with_sample_ids(load_dataset_dir(tokenized_dir / "train"), per_token=False)
        train_set = train_set.select_columns([*columns, packing.SAMPLE_IDS]).shuffle(seed=ORDER_SEED)
        return train_set.flatten_indices(), load_dataset_dir(tokenized_dir / "eval").select_columns(columns)

    def meter(self, tokenizer: Tokenizer, model: Model, packed: bool, max_length: int, seed: int) -> packing.BatchMeter:
        """TRL's unpaired-preference collator (each row, and its mismatched row for the KL term), counted for the
        padding fraction and the ledger."""
        from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

        # the tokenize stage already cut each row to tokenize.max_length
        return FeedbackMeter(DataCollatorForUnpairedPreference(pad_token_id=tokenizer.pad_token_id))

    def arguments(self, common: dict[str, Any], config: PipelineConfig) -> TrainingArguments:
        from trl import KTOConfig

        return KTOConfig(**common, beta=config.preference.beta, max_length=None, precompute_ref_log_probs=False)

    def trainer(self, model: Model, settings: dict[str, Any], model_config: ModelConfig, tokenizer: Tokenizer,
                seed: int) -> Trainer:
        """TRL's KTOTrainer on the encoded rows. With an adapter, KTOTrainer adds it and the reference is the same
        model with the adapter off; for full fine-tuning, the reference is a frozen copy of the starting model."""
        from trl import KTOTrainer

        class EncodedFeedbackKTOTrainer(PreEncoded, KTOTrainer):
            """Of TRL's preparation of the encoded rows only the mismatched completions of the KL term are left."""

            def beyond_tokens(self, dataset: Dataset, args: TrainingArguments) -> Dataset:
                if not self.calculate_KL:
                    return dataset
                return dataset.map(mismatched, batched=True, batch_size=args.per_device_train_batch_size)

        reference, lora = self.reference_and_lora(model_config, tokenizer, seed)
        # the KL term pairs each row with its neighbour's completion in a fixed-order batch: rows are read in order
        # (shuffled once by datasets()), whatever sampling the other objectives train with
        settings["args"].train_sampling_strategy = "sequential"
        return EncodedFeedbackKTOTrainer(model=model, ref_model=reference, peft_config=lora, **settings)

    # --- evaluate ------------------------------------------------------------------------------------------

    def default_primary(self, rows: list[dict[str, Any]]) -> tuple[str, str]:
        return PRIMARY

    def score(self, model: Model, tokenizer: Tokenizer, rows: list[dict[str, Any]], context: ScoringContext) -> Scored:
        """Per row: its parts of each metric, and its implied reward. Without a reference the model is its own,
        and every reward is 0."""
        encoded = self.encode(tokenizer, rows, context.encoding) if rows else {"prompt_ids": [], "completion_ids": []}
        reference: Reference | None = context.reference
        start_model = model if reference is None else reference.model
        beta = reference.beta if reference is not None else 0.0
        pad, batch_size = tokenizer.pad_token_id, context.settings.batch_size
        swapped = {"prompt_ids": encoded["prompt_ids"], "completion_ids": rotated(encoded["completion_ids"])}
        policy, tokens = completion_logps(model, encoded, pad, batch_size)
        mismatched_policy = completion_logps(model, swapped, pad, batch_size)[0]
        if start_model is model:  # the starting model scored against itself: every log-ratio is 0
            start, mismatched_start = policy, mismatched_policy
        else:
            start = completion_logps(start_model, encoded, pad, batch_size)[0]
            mismatched_start = completion_logps(start_model, swapped, pad, batch_size)[0]
        rewards = beta * (policy - start)
        kl = mismatched_policy - mismatched_start
        labels = np.asarray([bool(row["label"]) for row in rows], dtype=bool)
        with np.errstate(divide="ignore", invalid="ignore"):
            per_token = np.where(tokens > 0, policy / np.maximum(tokens, 1), 0.0)
        parts = {"reward_auc": placements(rewards, labels), "reward_margin": by_label(rewards, labels),
                 "likelihood_auc": placements(per_token, labels), "kl": means(kl.tolist())}
        return Scored(parts, [f"reward {reward:+.4f}" for reward in rewards], self.metrics)

    def limitations(self, config: PipelineConfig, metrics: dict[str, float]) -> list[str]:
        return [f"Its rewards are measured against its starting model ({config.model.name_or_path}): they say how far "
                "training moved it towards the feedback, not how good its answers are; likelihood_auc compares any "
                "two models."]


class FeedbackMeter(packing.BatchMeter):
    """Counts each row's prompt and completion, and the prompt and mismatched completion of its KL row."""

    def measure(self, examples: list[dict[str, Any]]) -> tuple[Any, packing.BatchFigures]:
        names = (*ID_COLUMNS, "KL_completion_ids", "label")
        rows = [{name: example[name] for name in names if name in example} for example in examples]
        batch = self.collate(rows)
        real = sum(len(row["prompt_ids"]) * (1 + ("KL_completion_ids" in row)) + len(row["completion_ids"]) +
                   len(row.get("KL_completion_ids", ())) for row in rows)
        slots = int(batch["input_ids"].numel()) + int(batch["KL_input_ids"].numel() if "KL_input_ids" in batch else 0)
        return batch, packing.BatchFigures(real=real, slots=slots)


def mismatched(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """KTO's KL rows: each prompt with the previous row's completion, within a batch (TRL's own pairing)."""
    return {"KL_completion_ids": rotated(batch["completion_ids"])}


def rotated(values: list[Any]) -> list[Any]:
    return [values[-1], *values[:-1]] if values else []


def completion_logps(model: Model, encoded: dict[str, list[Any]], pad_token_id: int,
                     batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the summed log-likelihood of the completion's tokens given the prompt, and how many there are."""
    sequences = {"input_ids": [], "labels": []}
    for prompt, completion in zip(encoded["prompt_ids"], encoded["completion_ids"], strict=True):
        sequences["input_ids"].append(list(prompt) + list(completion))
        sequences["labels"].append([IGNORE_INDEX] * len(prompt) + list(completion))
    if not sequences["input_ids"]:
        return np.zeros(0), np.zeros(0)
    nll, tokens = token_losses(model, sequences, pad_token_id, batch_size)
    return -np.asarray(nll, dtype=float), np.asarray(tokens, dtype=float)


def placements(scores: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Per row, its placement value (DeLong's), as (value, 1): for a desirable row the share of undesirable rows it
    out-scores, for an undesirable one the share of desirable rows that out-score it (ties count half). Their mean
    is the AUC, and a resample's mean that of the resample; (0, 0) where the other label has no row."""
    if len(scores) == 0:
        return np.zeros((0, 2))
    desirable, undesirable = scores[labels], scores[~labels]
    values = np.zeros(len(scores))
    counted = np.zeros(len(scores))
    if len(desirable) and len(undesirable):
        above = (scores[:, None] > undesirable[None, :]).sum(1) + 0.5 * (scores[:, None] == undesirable[None, :]).sum(1)
        below = (desirable[None, :] > scores[:, None]).sum(1) + 0.5 * (desirable[None, :] == scores[:, None]).sum(1)
        values = np.where(labels, above / len(undesirable), below / len(desirable))
        counted[:] = 1.0
    return np.column_stack([values, counted])


def by_label(values: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Parts of the desirable rows' mean minus the undesirable rows' (mean_difference)."""
    if len(values) == 0:
        return np.zeros((0, 4))
    desirable = labels.astype(float)
    return np.column_stack([values * desirable, desirable, values * (1 - desirable), 1 - desirable])

