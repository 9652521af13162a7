"""What the training process knows of the batches it trains on, with the batches collated elsewhere.

Batches are collated in DataLoader worker processes (train.speed.loader_workers), whose state this
process never sees: each training batch carries its own figures (packing.BatchFigures, put there by
the objective's meter), and the Tally takes them out of each batch as the Trainer draws it, before
the model sees it. The Trainer draws the micro-batches of an optimizer step before training on
them; the ledger takes them in order, one per micro-step, and what is taken counts as trained on:
the real tokens (without a GPU sync), the padding fraction and the attention length per sample.
With no workers the same happens in one process, so the ledger and the figures are the same
whatever the number of workers.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from llmops.text.packing import BatchFigures, BatchMeter


class Tally:
    """The figures of the batches drawn and not yet trained on, oldest first, and the sums over those trained on."""

    def __init__(self, meter: BatchMeter) -> None:
        self.meter = meter
        self.pending: deque[BatchFigures] = deque()
        # real tokens and token slots of the batches taken (trained on); sums of sample lengths and of their squares
        self.used_tokens = self.slots = 0
        self.length_sum = self.square_sum = 0

    def draw(self, batch: Any) -> None:
        """A batch the Trainer drew to train on: its figures are taken out of it and wait their turn."""
        figures = self.meter.figures_of(batch)
        if figures is not None:
            self.pending.append(figures)

    def take_ids(self) -> list[int]:
        """The sample ids of the oldest batch drawn and not yet trained on, which now counts as trained on."""
        if not self.pending:
            return []
        figures = self.pending.popleft()
        self.used_tokens += figures.real
        self.slots += figures.slots
        self.length_sum += figures.length_sum
        self.square_sum += figures.square_sum
        return list(figures.samples)

    def padding_fraction(self) -> float:
        return 1 - self.used_tokens / self.slots if self.slots else 0.0

    def attention_length(self) -> float | None:
        """The attention length per token of the samples trained on, sum(L^2) / sum(L): each sample attends to itself
        only (None: no lengths counted)."""
        return self.square_sum / self.length_sum if self.length_sum else None


def watch(trainer: Any, tally: Tally) -> None:
    """Every batch `trainer` draws to train on goes by `tally` first, in this process. Trainer callbacks never see a
    batch: the one place that does, whatever the objective's trainer, is the training loop's draw of each optimizer
    step's batches (Trainer.get_batch_samples), wrapped here for this trainer alone (evaluation batches are drawn
    elsewhere, and carry no figures)."""
    draw = trainer.get_batch_samples

    def drawn(epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list[Any], Any]:
        batches, items = draw(epoch_iterator, num_batches, device)
        for batch in batches:
            tally.draw(batch)
        return batches, items

    trainer.get_batch_samples = drawn
