"""Padding-free packing: several samples per sequence, position ids restarting at each sample.

Attention never crosses a sample boundary: batches carry no attention mask, and the model derives
the boundaries from the position ids. With a varlen kernel (FlashAttention) the whole batch is one
flat sequence; with SDPA or eager attention each packed row keeps its own block-causal mask, so the
attention cost stays per row (rows x length^2) instead of growing with the square of the batch.
Whether a model honours this is checked, not assumed: `packing_is_exact` compares packed forward
passes with separate ones before training relies on it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

from llmops.text.encoding import IGNORE_INDEX

log = logging.getLogger("llmops.packing")

SAMPLE_IDS = "sample_ids"
TOKEN_COLUMNS = ("input_ids", "labels", SAMPLE_IDS)
MODEL_COLUMNS = ("input_ids", "labels", "seq_lengths")
# the key of a training batch's own figures (BatchMeter), taken out of the batch before the model sees it
FIGURES = "llmops_batch_figures"


def with_sample_ids(dataset: Any, per_token: bool) -> Any:
    """Each row's index in the tokenized split, as one id (a row per sample) or repeated on every token (so that
    packing carries it into the packed row, where the ledger reads which samples a row holds)."""
    if per_token:
        return dataset.map(sample_ids_per_token, with_indices=True)
    return dataset.add_column(SAMPLE_IDS, list(range(len(dataset))))


def sample_ids_per_token(row: dict[str, Any], index: int) -> dict[str, list[int]]:
    # a module-level function: `datasets` hashes it by name, where a lambda it would disassemble into stdout, which a
    # flow that logs prints writes into the run's log
    return {SAMPLE_IDS: [index] * len(row["input_ids"])}


def pack(dataset: Any, seq_length: int) -> Any:
    """Best-fit-decreasing packing into sequences of at most `seq_length` tokens, with each sample's length kept."""
    from trl.data_utils import pack_dataset

    columns = [column for column in TOKEN_COLUMNS if column in dataset.column_names]
    return pack_dataset(dataset.select_columns(columns), seq_length, strategy="bfd")


VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3", "flash_attention_4")


def packed_collator(model: Any, pad_token_id: int, max_length: int | None = None) -> Any:
    """One flat sequence for varlen kernels; rows with their own block masks for the others, always `max_length` wide
    when it is given: one shape, one compilation (flex_attention compiles a kernel per shape, and so does a compiled
    model on any kernel: a batch of a new width would recompile in the middle of training). Packed rows are nearly
    full, so the padding costs little."""
    attention = getattr(model.config, "_attn_implementation", None)
    if attention in VARLEN_ATTENTION:
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

        return DataCollatorForLanguageModeling(pad_token_id=pad_token_id, padding_free=True)
    return PackedRows(pad_token_id, max_length)


class PackedRows:
    """Packed rows (with `seq_lengths`) as a [rows, length] batch; position ids restart at each sample."""

    def __init__(self, pad_token_id: int, width: int | None = None) -> None:
        self.pad_token_id, self.width = pad_token_id, width

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        width = self.width or max(len(example["input_ids"]) for example in examples)
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


@dataclass(frozen=True)
class PackingCheck:
    """What the packing check found: `exact` when packed samples get the logits they get alone; else `reason` says
    how the model mixes them (or rejects packed batches), or `failure` why the check could not tell (it ran out of
    memory, the attention kernel failed to compile, another error): a failure is never read as an answer."""

    exact: bool
    reason: str = ""
    failure: str | None = None


# where the errors of torch.compile's stack come from (dynamo, inductor, Triton's kernel compiler)
COMPILER_MODULES = ("torch._dynamo", "torch._inductor", "triton")


def packing_is_exact(model: Any, samples: list[list[int]], pad_token_id: int, tolerance: float = 1e-4,
                     device: Any = None, half: Any = None) -> bool:
    return check_packing(model, samples, pad_token_id, tolerance, device, half).exact


def check_packing(model: Any, samples: list[list[int]], pad_token_id: int, tolerance: float = 1e-4,
                  device: Any = None, half: Any = None) -> PackingCheck:
    """Whether the model gives each sample the same logits packed together (as training packs them) as alone, on
    `device` (the one training will use: the kernels under test exist only there; None: where the model is), in the
    `half` dtype training computes in on a GPU (None: the card's own, bf16 on sm80 and newer, else fp16). A model
    moved there for the check goes back where it was."""
    import torch

    was = next(model.parameters()).device
    device = torch.device(device) if device is not None else was
    on_gpu = device.type == "cuda"
    if on_gpu and half is None:
        half = torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else torch.float16
    # on a GPU the check runs as training will, in half precision (varlen kernels take nothing else): more noise
    tolerance = max(tolerance, 2e-2) if on_gpu else tolerance
    was_training = model.training
    model.eval()
    moved = device != was  # a 4-bit base is loaded where it trains, and cannot move
    try:
        if moved:
            model.to(device)
        with torch.no_grad(), torch.autocast(device.type, dtype=half, enabled=on_gpu):
            return compare_packed(model, samples, pad_token_id, tolerance, device)
    except (TypeError, ValueError) as err:  # a model whose forward rejects position-only batches
        return PackingCheck(False, reason=f"its forward rejects packed batches ({first_line(err)})")
    except Exception as err:  # noqa: BLE001 - told apart below, and never read as an answer
        return PackingCheck(False, failure=failure_of(err, device))
    finally:
        model.train(was_training)
        if moved:
            model.to(was)


def compare_packed(model: Any, samples: list[list[int]], pad_token_id: int, tolerance: float,
                   device: Any) -> PackingCheck:
    import torch

    row = {"input_ids": [t for s in samples for t in s], "seq_lengths": [len(s) for s in samples]}
    collated = packed_collator(model, pad_token_id)([row])
    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in collated.items() if k != "labels"}
    packed = model(**batch, use_cache=False).logits[0].float()
    offset = 0
    for sample in samples:
        alone = model(input_ids=torch.tensor([sample], device=device), use_cache=False).logits[0].float()
        difference = (packed[offset:offset + len(sample)] - alone).abs().max().item()
        if difference > tolerance * max(1.0, alone.abs().max().item()):
            return PackingCheck(False, reason=f"packed samples get other logits than alone (off by {difference:.3g})")
        offset += len(sample)
    return PackingCheck(True)


def failure_of(err: BaseException, device: Any) -> str:
    """Why the check could not run, in words: out of memory, a kernel that failed to compile, or the error itself."""
    import torch

    if isinstance(err, torch.OutOfMemoryError):
        return f"it ran out of memory on {device} ({first_line(err)})"
    if type(err).__module__.startswith(COMPILER_MODULES):
        return f"the attention kernel failed to compile ({type(err).__name__}: {first_line(err)})"
    return f"it failed with {type(err).__name__}: {first_line(err)}"


def first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0][:300] if lines else type(err).__name__


@dataclass(frozen=True)
class BatchFigures:
    """What the training process keeps of one training batch: its samples' ids in order (for the ledger), its real
    tokens and token slots (tokens trained on, padding fraction) and the sums of its samples' lengths and of their
    squares (the attention term of the model FLOPs; 0 where a meter does not count them)."""

    samples: tuple[int, ...] = ()
    real: int = 0
    slots: int = 0
    length_sum: int = 0
    square_sum: int = 0


class BatchMeter:
    """A collator wrapper that measures each training batch as it builds it and puts the figures into the batch under
    FIGURES, for the training process to take out before the model sees the batch (training/tally.py). It keeps no
    state: it may run in a DataLoader worker process, whose state the training process never sees. Only batches of
    rows that carry sample ids (the training rows) get figures; evaluation batches go to the model as collated."""

    def __init__(self, collate: Any, columns: tuple[str, ...] = MODEL_COLUMNS) -> None:
        self.collate, self.columns = collate, columns

    def __call__(self, examples: list[dict[str, Any]]) -> Any:
        batch, figures = self.measure(examples)
        if any(SAMPLE_IDS in example for example in examples):
            samples = tuple(sample for example in examples for sample in samples_in(example))
            batch[FIGURES] = dataclasses.replace(figures, samples=samples)
        return batch

    def measure(self, examples: list[dict[str, Any]]) -> tuple[Any, BatchFigures]:
        """The batch and its figures: real tokens, token slots, and the samples' lengths."""
        # only what the model reads: the `length` column is for the length-grouped sampler
        examples = [{k: v for k, v in example.items() if k in self.columns} for example in examples]
        batch = self.collate(examples)
        lengths = [n for example in examples for n in example.get("seq_lengths") or [len(example["input_ids"])]]
        return batch, BatchFigures(real=sum(len(example["input_ids"]) for example in examples),
                                   slots=int(batch["input_ids"].numel()), length_sum=sum(lengths),
                                   square_sum=sum(n * n for n in lengths))

    def figures_of(self, batch: Any) -> BatchFigures | None:
        """A drawn batch's figures, taken out of it (None: a batch without them), in the training process."""
        return batch.pop(FIGURES, None) if isinstance(batch, MutableMapping) else None


def samples_in(example: dict[str, Any]) -> list[int]:
    """The distinct sample ids of a row, in order (a packed row repeats each id on every token of its sample)."""
    ids = example.get(SAMPLE_IDS)
    if ids is None:
        return []
    if isinstance(ids, int):
        return [ids]
    return [int(value) for index, value in enumerate(ids) if index == 0 or ids[index - 1] != value]
