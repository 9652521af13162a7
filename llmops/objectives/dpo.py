"""DPO on preference pairs: encoding through the SFT chat template, TRL's DPOTrainer, and the held-out metrics.

Prompt and answer are rendered through the chat template exactly as SFT renders an instruction and
its response, so a model fine-tuned here carries its format over; an answer's tokens run through
the end-of-turn marker, as SFT's labels do. The tokenize stage caches the encoded pairs and TRL's
DPOTrainer trains on them, with a LoRA adapter by default (its reference is the starting model,
the adapter switched off) or a frozen copy of the starting model for full fine-tuning. Held out:
`preference_accuracy`, the share of pairs whose chosen answer gets the higher summed
log-likelihood (no reference: any two models compare on it), and `reward_margin`, DPO's implicit
reward of chosen over rejected, beta * (log-ratio to the starting model of chosen minus that of
rejected), 0 for the starting model itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llmops.config.schema import ModelConfig, PipelineConfig
from llmops.io.files import load_dataset_dir
from llmops.models import modeling
from llmops.objectives.base import Encoding, ScoringContext
from llmops.objectives.encoded import pre_encoded
from llmops.objectives.language import LanguageModel
from llmops.objectives.metrics import Metric, Scored, means, ratio, table
from llmops.records.preference import PREFERENCE
from llmops.records.turns import conversation
from llmops.text import packing
from llmops.text.encoding import IGNORE_INDEX, response_labels
from llmops.text.templates import renderer_for

if TYPE_CHECKING:
    import pyarrow as pa
    from datasets import Dataset
    from peft import LoraConfig as PeftLoraConfig
    from transformers import Trainer, TrainingArguments

    from llmops.objectives.base import Model, Tokenizer

ANSWERS = ("chosen", "rejected")
ID_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
# the held-out metrics every preference objective reports (ORPO's too)
METRICS = table(
    Metric("preference_accuracy", ratio, True, "share of pairs whose chosen answer is likelier than the rejected one"),
    Metric("reward_margin", ratio, True, "mean DPO reward of the chosen answer over the rejected one, against the "
           "starting model"))
PRIMARY = ("preference_accuracy", "preference pairs: how often the model finds the chosen answer likelier than the "
                                  "rejected one, whichever model it started from")


@dataclass
class Reference:
    """The starting model the reward margin is measured against, and DPO's beta."""

    model: Model
    beta: float


class DPO(LanguageModel):
    name = "dpo"
    section = "preference"
    needs_offsets = True
    kinds = (PREFERENCE,)
    summary = "preference optimization (DPO) on chosen/rejected answer pairs"
    metrics = METRICS
    packable = False
    needs_base = True
    measured_against_start = True

    def defaults(self, raw: dict[str, Any]) -> dict[str, Any]:
        """A LoRA adapter unless model.adapter says otherwise: the reference model is then the base with the
        adapter off, not a second copy."""
        model = raw.get("model")
        if isinstance(model, dict) and model.get("name_or_path") and "adapter" not in model:
            return {**raw, "model": {**model, "adapter": "lora"}}
        return raw

    # --- tokenize ------------------------------------------------------------------------------------------

    def encode(self, tokenizer: Tokenizer, rows: list[dict[str, Any]], encoding: Encoding) -> dict[str, list[Any]]:
        """Prompt ids and each answer's ids (through the end-of-turn marker), rendered as SFT renders a response.
        Answers are cut so that prompt and answer fit `max_length`; a prompt that leaves no room has no target."""
        render = renderer_for(tokenizer)
        sides = {}
        for answer in ANSWERS:
            rendered = [render(conversation(row["prompt"], row[answer])) for row in rows]
            encodings = tokenizer.backend_tokenizer.encode_batch([text for text, _ in rendered],
                                                                 add_special_tokens=False)
            sides[answer] = [split_answer(item.ids, response_labels(item, item.ids, spans[-1:]))
                             for item, (_, spans) in zip(encodings, rendered, strict=True)]
        batch: dict[str, list[Any]] = {name: [] for name in (*ID_COLUMNS, "labels", "raw_length", "length",
                                                              "has_target")}
        for (prompt_c, chosen), (prompt_r, rejected) in zip(sides["chosen"], sides["rejected"], strict=True):
            shared = common_prefix(prompt_c, prompt_r)
            prompt, chosen, rejected = prompt_c[:shared], prompt_c[shared:] + chosen, prompt_r[shared:] + rejected
            room = max(encoding.max_length - len(prompt), 0)
            batch["prompt_ids"].append(prompt)
            batch["chosen_ids"].append(chosen[:room])
            batch["rejected_ids"].append(rejected[:room])
            batch["labels"].append(chosen[:room] + rejected[:room])  # the tokens trained on, for the figures
            batch["raw_length"].append(len(prompt) + max(len(chosen), len(rejected)))
            batch["length"].append(min(batch["raw_length"][-1], encoding.max_length))
            batch["has_target"].append(room > 0 and bool(chosen) and bool(rejected))
        return batch

    def arrow_schema(self) -> pa.Schema:
        import pyarrow as pa

        return pa.schema([(name, pa.list_(pa.int32())) for name in ID_COLUMNS] +
                         [("raw_length", pa.int32()), ("length", pa.int32())])

    # --- train ---------------------------------------------------------------------------------------------

    def with_adapter(self, model: Model, model_config: ModelConfig, gradient_checkpointing: bool) -> Model:
        return model  # DPOTrainer adds the adapter, so that its reference is the adapter switched off

    def datasets(self, tokenized_dir: Path, packed: bool, max_length: int) -> tuple[Dataset, Dataset]:
        """Training pairs with their sample ids (for the ledger); held-out pairs as they are."""
        train_set = load_dataset_dir(tokenized_dir / "train")
        eval_set = load_dataset_dir(tokenized_dir / "eval").select_columns(list(ID_COLUMNS))
        train_set = packing.with_sample_ids(train_set, per_token=False)
        return train_set.select_columns([*ID_COLUMNS, packing.SAMPLE_IDS]), eval_set

    def meter(self, tokenizer: Tokenizer, model: Model, packed: bool, max_length: int, seed: int) -> packing.BatchMeter:
        """TRL's preference collator (chosen rows, then rejected rows, with a completion mask), counted for the
        padding fraction and the ledger."""
        from trl.trainer.dpo_trainer import DataCollatorForPreference

        # the tokenize stage already cut each pair to tokenize.max_length
        return PreferenceMeter(DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id, max_length=None))

    def arguments(self, common: dict[str, Any], config: PipelineConfig) -> TrainingArguments:
        from trl import DPOConfig

        return DPOConfig(**common, beta=config.preference.beta, max_length=None, precompute_ref_log_probs=False)

    def trainer(self, model: Model, settings: dict[str, Any], model_config: ModelConfig, tokenizer: Tokenizer,
                seed: int) -> Trainer:
        """TRL's DPOTrainer on the encoded pairs. With an adapter, DPOTrainer adds it and the reference is the same
        model with the adapter off; for full fine-tuning, the reference is a frozen copy of the starting model."""
        from trl import DPOTrainer

        reference, lora = self.reference_and_lora(model_config, tokenizer, seed)
        return pre_encoded(DPOTrainer)(model=model, ref_model=reference, peft_config=lora, **settings)

    def reference_and_lora(self, model_config: ModelConfig, tokenizer: Tokenizer,
                           seed: int) -> tuple[Model | None, PeftLoraConfig | None]:
        """The trainer's reference model and LoRA settings: with an adapter, no reference (the trainer's is the
        model with the adapter off) and the adapter's settings; without, a frozen copy of the starting model."""
        if model_config.adapter != "none":
            return None, modeling.lora_settings(model_config.lora, self.peft_task)
        return self.build_model(model_config, tokenizer, seed, []).eval().requires_grad_(False), None

    # --- evaluate ------------------------------------------------------------------------------------------

    def default_primary(self, rows: list[dict[str, Any]]) -> tuple[str, str]:
        return PRIMARY

    def reference(self, start: Model, config: PipelineConfig) -> Reference:
        return Reference(start, config.preference.beta)

    def score(self, model: Model, tokenizer: Tokenizer, rows: list[dict[str, Any]], context: ScoringContext) -> Scored:
        """Per-pair parts of preference_accuracy and reward_margin, and which answer the model prefers. Without a
        reference the model is its own, and every margin is 0."""
        encoded = self.encode(tokenizer, rows, context.encoding) if rows else {name: [] for name in ID_COLUMNS}
        batch_size, reference = context.settings.batch_size, context.reference
        policy = answer_logps(model, encoded, tokenizer.pad_token_id, batch_size)
        start = policy if reference is None else answer_logps(reference.model, encoded, tokenizer.pad_token_id,
                                                              batch_size)
        beta = reference.beta if reference is not None else 0.0
        hits = [float(chosen > rejected) for chosen, rejected in policy]
        margins = [beta * ((pc - rc) - (pr - rr)) for (pc, pr), (rc, rr) in zip(policy, start, strict=True)]
        preferred = ["chosen" if hit else "rejected" for hit in hits]
        return Scored({"preference_accuracy": means(hits), "reward_margin": means(margins)}, preferred, self.metrics)


class PreferenceMeter(packing.BatchMeter):
    """Counts a pair's prompt twice (it is in the chosen row and the rejected row) and both answers."""

    def measure(self, examples: list[dict[str, Any]]) -> tuple[Any, packing.BatchFigures]:
        pairs = [{name: example[name] for name in ID_COLUMNS} for example in examples]
        batch = self.collate(pairs)
        real = sum(2 * len(p["prompt_ids"]) + len(p["chosen_ids"]) + len(p["rejected_ids"]) for p in pairs)
        return batch, packing.BatchFigures(real=real, slots=self.slots_in(batch))

    def slots_in(self, batch: dict[str, Any]) -> int:
        """The token slots of a batch, padding included: its chosen and rejected rows."""
        return int(batch["input_ids"].numel())


def split_answer(ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
    """The tokens before the answer, and the answer's tokens (the labelled ones)."""
    first = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(ids))
    last = max((i for i, label in enumerate(labels) if label != IGNORE_INDEX), default=first - 1)
    return ids[:first], ids[first:last + 1]


def common_prefix(a: list[int], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


def answer_logps(model: Model, encoded: dict[str, list[Any]], pad_token_id: int, batch_size: int) -> np.ndarray:
    """Per pair: the summed log-likelihood of the chosen answer's tokens and of the rejected answer's, given the
    prompt. Shape (pairs, 2)."""
    import torch

    sequences = [(prompt, answer) for answer in ("chosen_ids", "rejected_ids")
                 for prompt, answer in zip(encoded["prompt_ids"], encoded[answer], strict=True)]
    sums: list[float] = []
    with torch.no_grad():
        for start in range(0, len(sequences), batch_size):
            chunk = sequences[start:start + batch_size]
            width = max(len(p) + len(a) for p, a in chunk)
            ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)
            labels = torch.full((len(chunk), width), IGNORE_INDEX, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, (prompt, answer) in enumerate(chunk):
                ids[row, :len(prompt) + len(answer)] = torch.tensor(prompt + answer)
                labels[row, len(prompt):len(prompt) + len(answer)] = torch.tensor(answer, dtype=torch.long)
                mask[row, :len(prompt) + len(answer)] = 1
            batch = modeling.on_device({"input_ids": ids, "attention_mask": mask, "labels": labels}, model)
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
            targets = batch["labels"][:, 1:]
            nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), targets,
                                                    ignore_index=IGNORE_INDEX, reduction="none")
            sums.extend((-nll.sum(dim=1)).tolist())
    pairs = len(encoded["prompt_ids"])
    return np.column_stack([sums[:pairs], sums[pairs:]]) if pairs else np.zeros((0, 2))
