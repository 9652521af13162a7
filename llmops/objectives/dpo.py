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
from typing import Any

import numpy as np

from llmops.core import metrics, workspace
from llmops.models import modeling
from llmops.objectives import preference
from llmops.text import packing, templates

ANSWERS = ("chosen", "rejected")
IGNORE_INDEX = -100
ID_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


# --- tokenize ----------------------------------------------------------------------------------------------


def encode(tokenizer: Any, renderer: templates.ShapeRenderer, rows: list[dict[str, Any]],
           max_length: int) -> dict[str, list[Any]]:
    """Prompt ids and each answer's ids (through the end-of-turn marker), rendered as SFT renders a response.
    Answers are cut so that prompt and answer fit `max_length`; a prompt that leaves no room has no target."""
    from llmops.data.tokenize import response_labels

    sides = {}
    for answer in ANSWERS:
        rendered = [renderer(preference.conversation(row, answer)) for row in rows]
        encodings = tokenizer.backend_tokenizer.encode_batch([text for text, _ in rendered], add_special_tokens=False)
        sides[answer] = [split_answer(encoding.ids, response_labels(encoding, encoding.ids, spans[-1:]))
                         for encoding, (_, spans) in zip(encodings, rendered, strict=True)]
    batch: dict[str, list[Any]] = {name: [] for name in (*ID_COLUMNS, "labels", "raw_length", "length", "has_target")}
    for (prompt_c, chosen), (prompt_r, rejected) in zip(sides["chosen"], sides["rejected"], strict=True):
        shared = common_prefix(prompt_c, prompt_r)
        prompt, chosen, rejected = prompt_c[:shared], prompt_c[shared:] + chosen, prompt_r[shared:] + rejected
        room = max(max_length - len(prompt), 0)
        batch["prompt_ids"].append(prompt)
        batch["chosen_ids"].append(chosen[:room])
        batch["rejected_ids"].append(rejected[:room])
        batch["labels"].append(chosen[:room] + rejected[:room])  # the tokens trained on, for the figures
        batch["raw_length"].append(len(prompt) + max(len(chosen), len(rejected)))
        batch["length"].append(min(batch["raw_length"][-1], max_length))
        batch["has_target"].append(room > 0 and bool(chosen) and bool(rejected))
    return batch


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


def arrow_schema() -> Any:
    import pyarrow as pa

    return pa.schema([(name, pa.list_(pa.int32())) for name in ID_COLUMNS] +
                     [("raw_length", pa.int32()), ("length", pa.int32())])


# --- train -------------------------------------------------------------------------------------------------


def datasets_for(tokenized_dir: Path) -> tuple[Any, Any]:
    """Training pairs with their sample ids (for the ledger); held-out pairs as they are."""
    train_set = workspace.load_dataset_dir(tokenized_dir / "train")
    eval_set = workspace.load_dataset_dir(tokenized_dir / "eval").select_columns(list(ID_COLUMNS))
    return packing.with_sample_ids(train_set, per_token=False).select_columns([*ID_COLUMNS, packing.SAMPLE_IDS]), \
        eval_set


def meter(pad_token_id: int) -> Any:
    """TRL's preference collator (chosen rows, then rejected rows, with a completion mask), counted for the
    padding fraction and the ledger."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    class PreferenceMeter(packing.BatchMeter):
        def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
            self.pending.append([sample for example in examples for sample in packing.samples_in(example)])
            pairs = [{name: example[name] for name in ID_COLUMNS} for example in examples]
            batch = self.collate(pairs)
            self.real += sum(2 * len(p["prompt_ids"]) + len(p["chosen_ids"]) + len(p["rejected_ids"]) for p in pairs)
            self.slots += int(batch["input_ids"].numel())
            return batch

    # the tokenize stage already cut each pair to tokenize.max_length
    return PreferenceMeter(DataCollatorForPreference(pad_token_id=pad_token_id, max_length=None))


def arguments(common: dict[str, Any], beta: float) -> Any:
    from trl import DPOConfig

    return DPOConfig(**common, beta=beta, max_length=None, precompute_ref_log_probs=False)


def trainer(model: Any, reference: Any, lora: Any, **settings: Any) -> Any:
    """TRL's DPOTrainer on the encoded pairs. With a LoRA config the adapter is added here, and the reference is
    the same model with the adapter off; without one, `reference` is a frozen copy of the starting model."""
    from trl import DPOTrainer

    class EncodedPairsDPOTrainer(DPOTrainer):
        """The pairs arrive encoded by the tokenize stage (cached, rendered with the SFT template): TRL's own
        rendering and tokenizing of text columns has nothing to do."""

        def _prepare_dataset(self, dataset: Any, *args: Any, **kwargs: Any) -> Any:
            return dataset

    return EncodedPairsDPOTrainer(model=model, ref_model=reference, peft_config=lora, **settings)


# --- evaluate ----------------------------------------------------------------------------------------------


@dataclass
class Reference:
    """The starting model the reward margin is measured against, and DPO's beta."""

    model: Any
    beta: float


def answer_logps(model: Any, encoded: dict[str, list[Any]], pad_token_id: int, batch_size: int) -> np.ndarray:
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


def score(model: Any, tokenizer: Any, rows: list[dict[str, Any]], max_length: int, batch_size: int,
          reference: Reference | None) -> tuple[dict[str, np.ndarray], list[str]]:
    """Per-pair parts of preference_accuracy and reward_margin, and which answer the model prefers. Without a
    reference the model is its own, and every margin is 0."""
    encoded = encode(tokenizer, templates.ShapeRenderer(tokenizer), rows, max_length) if rows else \
        {name: [] for name in ID_COLUMNS}
    policy = answer_logps(model, encoded, tokenizer.pad_token_id, batch_size)
    start = policy if reference is None else answer_logps(reference.model, encoded, tokenizer.pad_token_id,
                                                          batch_size)
    beta = reference.beta if reference is not None else 0.0
    hits = [float(chosen > rejected) for chosen, rejected in policy]
    margins = [beta * ((pc - rc) - (pr - rr)) for (pc, pr), (rc, rr) in zip(policy, start, strict=True)]
    preferred = ["chosen" if hit else "rejected" for hit in hits]
    return {"preference_accuracy": metrics.means(hits), "reward_margin": metrics.means(margins)}, preferred
