"""What went wrong while training, as metrics: checkpoint saves that failed, batches that could not be loaded, and
running out of GPU memory.

Each is counted where it happens, in the process that saw it, and logged on the run at once as
`train/<figure>` (the step it happened at; the error itself still ends the training in its one
line); a training that ends well logs each count (zero) with its last step, so that a run's
dashboard shows the figure either way. Skipped steps are `train/nonfinite_steps`
(training/nonfinite.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback

from llmops.tracking.log import RunHandle, log_metrics, metric_name

log = logging.getLogger("llmops.train")
SAVE_FAILURES, DATA_ERRORS, OOM_EVENTS = "checkpoint_save_failures", "data_errors", "oom_events"


class FaultCounter(TrainerCallback):
    """Counts the faults of one training by wrapping the Trainer's steps that meet them (this trainer alone)."""

    def __init__(self, run: RunHandle | None) -> None:
        self.run = run
        self.counts = {SAVE_FAILURES: 0, DATA_ERRORS: 0, OOM_EVENTS: 0}
        # the trainer's step now (the Trainer makes a new state when it starts training)
        self.step: Callable[[], int] = lambda: 0

    def attach(self, trainer: Any) -> None:
        """Count a failing checkpoint save (the Trainer's, then the callbacks' that complete and copy it), batch draw
        (loading and collating) and training step (out of memory)."""
        import torch

        self.step = lambda: int(trainer.state.global_step)
        trainer._save_checkpoint = self.counting(trainer._save_checkpoint, SAVE_FAILURES, Exception)
        # what a checkpoint's save goes on with: its manifest, the copy to the checkpoint store (callbacks.py)
        handler = trainer.callback_handler
        handler.on_save = self.counting(handler.on_save, SAVE_FAILURES, Exception)
        trainer.get_batch_samples = self.counting(trainer.get_batch_samples, DATA_ERRORS, Exception)
        trainer.training_step = self.counting(trainer.training_step, OOM_EVENTS, torch.OutOfMemoryError)

    def counting(self, step: Callable[..., Any], figure: str, kind: type[BaseException]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            try:
                return step(*args, **kwargs)
            except kind:
                self.record(figure)
                raise

        return counted

    def record(self, figure: str) -> None:
        self.counts[figure] += 1
        step = self.step()
        log.warning("%s at step %d", figure.replace("_", " "), step)
        try:
            self.send({figure: self.counts[figure]}, step)
        except Exception as err:  # the tracking may be what fails: the fault's own error matters more
            log.warning("could not log %s: %s", figure, err)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            self.send(self.counts, state.global_step)

    def send(self, counts: dict[str, int], step: int) -> None:
        """On the run, whichever process saw it: a fault on another rank than the first is counted too."""
        if self.run is not None:
            log_metrics(
                self.run.tracking,
                self.run.run_id,
                {metric_name("train", figure): float(count) for figure, count in counts.items()},
                step=step,
            )
