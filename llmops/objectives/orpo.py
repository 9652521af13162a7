"""ORPO on preference pairs: DPO's encoding and metrics, TRL's ORPOTrainer, and no reference model in training.

ORPO (odds-ratio preference optimization) trains in one loss what SFT and DPO train in two: the
likelihood of the chosen answer (its tokens alone, as SFT's labels), plus `preference.beta`
(ORPO's lambda) times the log-sigmoid of the log odds ratio of chosen over rejected (each answer's
mean per-token log-likelihood). No reference model takes part, so a full fine-tune holds one copy
of the model. The pairs are the ones DPO trains on (objectives/dpo.py: the prompt through the SFT
chat template, the answers through the end-of-turn marker, cached by the tokenize stage), and
held-out pairs are scored as DPO scores them: `preference_accuracy` (reference-free) and
`reward_margin`, DPO's implicit reward of chosen over rejected against the starting model, so that
an ORPO and a DPO version of the same data compare on the same figures.
"""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from llmops.config.schema import ModelConfig, PipelineConfig
from llmops.models import modeling
from llmops.objectives.dpo import DPO, PreferenceMeter
from llmops.objectives.encoded import PreEncoded
from llmops.text import packing
from llmops.text.encoding import IGNORE_INDEX

if TYPE_CHECKING:
    from transformers import Trainer, TrainingArguments

    from llmops.objectives.base import Model, Tokenizer


class ORPO(DPO):
    name = "orpo"
    summary = "odds-ratio preference optimization (ORPO) on chosen/rejected answer pairs, without a reference model"

    def meter(self, tokenizer: Tokenizer, model: Model, packed: bool, max_length: int, seed: int) -> packing.BatchMeter:
        """The encoded pairs as ORPOTrainer reads them (chosen and rejected sequences with their labels), counted
        for the padding fraction and the ledger."""
        return OddsRatioMeter(PairCollator(pad_token_id=tokenizer.pad_token_id))

    def arguments(self, common: dict[str, Any], config: PipelineConfig) -> TrainingArguments:
        return experimental("orpo").ORPOConfig(**common, beta=config.preference.beta)

    def trainer(self, model: Model, settings: dict[str, Any], model_config: ModelConfig, tokenizer: Tokenizer,
                seed: int) -> Trainer:
        """TRL's ORPOTrainer on the encoded pairs; with an adapter, ORPOTrainer adds it (no reference to keep)."""
        class EncodedPairsORPOTrainer(PreEncoded, experimental("orpo").ORPOTrainer):
            def concatenated_forward(self, model: Model, batch: dict[str, Any]) -> tuple[Any, ...]:
                """ORPO's likelihood term on the chosen answer alone, as the ORPO paper's SFT loss and as SFT here
                trains (TRL's takes it over the prompt too, whose tokens the data does not teach): the mean over
                the pairs of the answer's mean per-token negative log-likelihood."""
                chosen, rejected, chosen_logits, rejected_logits, _, *rest = super().concatenated_forward(model, batch)
                return (chosen, rejected, chosen_logits, rejected_logits, -chosen.mean(), *rest)

        lora = modeling.lora_settings(model_config.lora, self.peft_task) if model_config.adapter != "none" else None
        return EncodedPairsORPOTrainer(model=model, peft_config=lora, **settings)


@dataclass
class PairCollator:
    """Encoded pairs as ORPOTrainer's batch: the prompt, and each answer's sequence (the prompt then the answer)
    with its attention mask and labels (IGNORE_INDEX on the prompt), padded by TRL's own collator."""

    pad_token_id: int

    def __call__(self, pairs: list[dict[str, Any]]) -> dict[str, Any]:
        collate = experimental("utils").DPODataCollatorWithPadding(pad_token_id=self.pad_token_id)
        return collate([sequences(pair) for pair in pairs])


def sequences(pair: dict[str, Any]) -> dict[str, list[int]]:
    """One pair as ORPOTrainer's row: `prompt_*`, `chosen_*` and `rejected_*` input ids, attention masks, labels."""
    prompt = list(pair["prompt_ids"])
    row = {"prompt_input_ids": prompt, "prompt_attention_mask": [1] * len(prompt)}
    for answer in ("chosen", "rejected"):
        ids = list(pair[f"{answer}_ids"])
        row[f"{answer}_input_ids"] = prompt + ids
        row[f"{answer}_attention_mask"] = [1] * (len(prompt) + len(ids))
        row[f"{answer}_labels"] = [IGNORE_INDEX] * len(prompt) + ids
    return row


class OddsRatioMeter(PreferenceMeter):
    """DPO's meter, counting the slots of ORPO's separate chosen and rejected rows."""

    def slots_in(self, batch: dict[str, Any]) -> int:
        return int(batch["chosen_input_ids"].numel() + batch["rejected_input_ids"].numel())


def experimental(name: str) -> ModuleType:
    """A module of trl.experimental, where TRL 1.16 keeps ORPO; its import warns, on every run, that the API may
    change (the TRL version is pinned, and recorded with each version)."""
    from trl.import_utils import TRLExperimentalWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TRLExperimentalWarning)
        return importlib.import_module(f"trl.experimental.{name}")
