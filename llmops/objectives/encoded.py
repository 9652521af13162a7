"""TRL's trainers on the rows the tokenize stage encoded, taken as they are.

The tokenize stage renders each record through the chat template as SFT renders it, encodes it,
cuts it to `tokenize.max_length` and caches it under its key; a TRL trainer would extract, render
and tokenize text columns again when it prepares a dataset. `PreEncoded`, first among the bases of
a TRL trainer's subclass, makes that preparation leave the encoded rows as they are, adding only
what TRL adds beyond tokens (`beyond_tokens`: KTO's mismatched completions);
`pre_encoded(trainer_class)` is that subclass when nothing else changes.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import TrainingArguments

    from llmops.objectives.base import Model, Tokenizer


class PreEncoded:
    """A TRL trainer's preparation of a dataset, for rows already encoded: nothing to render or tokenize."""

    def _prepare_dataset(self, dataset: Dataset, processing_class: Tokenizer, args: TrainingArguments,
                         dataset_name: str) -> Dataset:
        """Where DPOTrainer, KTOTrainer and RewardTrainer render and tokenize a dataset's text columns."""
        return self.beyond_tokens(dataset, args)

    def tokenize_row(self, feature: dict[str, Any], model: Model | None = None) -> dict[str, Any]:
        """Where ORPOTrainer (trl.experimental) tokenizes a row's text columns, after its other maps find no text to
        change; its collator lays the encoded row out."""
        return feature

    def beyond_tokens(self, dataset: Dataset, args: TrainingArguments) -> Dataset:
        """What the trainer's preparation adds to encoded rows besides tokens: nothing, unless a subclass says."""
        return dataset


@functools.cache
def pre_encoded(trainer_class: type) -> type:
    """`trainer_class` taking the encoded rows as they are, otherwise unchanged (one class per trainer class)."""
    return type(f"PreEncoded{trainer_class.__name__}", (PreEncoded, trainer_class), {"__module__": __name__})
