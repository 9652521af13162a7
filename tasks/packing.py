"""Padding-free packing: several samples per sequence, position ids restarting at each sample.

Attention never crosses a sample boundary: batches carry no attention mask, and the model derives
the boundaries from the position ids. With a varlen kernel (FlashAttention) the whole batch is one
flat sequence; with SDPA or eager attention each packed row keeps its own block-causal mask, so the
attention cost stays per row (rows x length^2) instead of growing with the square of the batch.
Whether a model honours this is checked, not assumed: `packing_is_exact` compares packed forward
passes with separate ones before training relies on it.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("llmops.packing")

IGNORE_INDEX = -100
TOKEN_COLUMNS = ("input_ids", "labels")
MODEL_COLUMNS = ("input_ids", "labels", "seq_lengths")


def pack(dataset: Any, seq_length: int) -> Any:
    """Best-fit-decreasing packing into sequences of at most `seq_length` tokens, with each sample's length kept."""
    from trl.data_utils import pack_dataset

    return pack_dataset(dataset.select_columns(list(TOKEN_COLUMNS)), seq_length, strategy="bfd")


VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3")


def packed_collator(model: Any, pad_token_id: int) -> Any:
    """One flat sequence for varlen kernels; rows with their own block masks for the others."""
    if getattr(model.config, "_attn_implementation", None) in VARLEN_ATTENTION:
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

        return DataCollatorForLanguageModeling(pad_token_id=pad_token_id, padding_free=True)
    return PackedRows(pad_token_id)


class PackedRows:
    """Packed rows (with `seq_lengths`) as a [rows, length] batch; position ids restart at each sample."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        width = max(len(example["input_ids"]) for example in examples)
        input_ids, labels, positions = [], [], []
        for example in examples:
            ids = list(example["input_ids"])
            lengths = list(example.get("seq_lengths") or [len(ids)])
            pad = width - len(ids)
            # padding forms its own segment: no real token attends to it (it comes later, attention is causal)
            position = [p for n in [*lengths, pad] if n for p in range(n)]
            target = list(example.get("labels", ids))
            for start in (sum(lengths[:i]) for i in range(len(lengths))):
                target[start] = IGNORE_INDEX  # no sample learns to predict another's first token
            input_ids.append(ids + [self.pad_token_id] * pad)
            labels.append(target + [IGNORE_INDEX] * pad)
            positions.append(position)
        return {"input_ids": torch.tensor(input_ids), "labels": torch.tensor(labels),
                "position_ids": torch.tensor(positions)}


def packing_is_exact(model: Any, samples: list[list[int]], pad_token_id: int, tolerance: float = 1e-4) -> bool:
    """Whether the model gives each sample the same logits packed together (as training packs them) as alone."""
    import torch

    collate = packed_collator(model, pad_token_id)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            row = {"input_ids": [t for s in samples for t in s], "seq_lengths": [len(s) for s in samples]}
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in collate([row]).items() if k != "labels"}
            packed = model(**batch, use_cache=False).logits[0].float()
            offset = 0
            for sample in samples:
                alone = model(input_ids=torch.tensor([sample], device=device), use_cache=False).logits[0].float()
                if (packed[offset:offset + len(sample)] - alone).abs().max().item() > tolerance * max(
                        1.0, alone.abs().max().item()):
                    return False
                offset += len(sample)
    except (TypeError, ValueError, RuntimeError) as err:  # a model whose forward rejects position-only batches
        log.info("packing check failed to run: %s", err)
        return False
    finally:
        model.train(was_training)
    return True


class PaddingMeter:
    """A collator wrapper that counts real and padded token slots, for the padding fraction."""

    def __init__(self, collate: Any) -> None:
        self.collate = collate
        self.real = 0
        self.slots = 0

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        # only what the model reads: the `length` column is for the length-grouped sampler
        examples = [{k: v for k, v in example.items() if k in MODEL_COLUMNS} for example in examples]
        batch = self.collate(examples)
        self.real += sum(len(example["input_ids"]) for example in examples)
        self.slots += int(batch["input_ids"].numel())
        return batch

    def padding_fraction(self) -> float:
        return 1 - self.real / self.slots if self.slots else 0.0
