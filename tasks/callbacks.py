"""Trainer callbacks: live training figures for the run's record and the console."""

from __future__ import annotations

import logging
import time
from typing import Any

from transformers import TrainerCallback

from tasks.tracking import RunHandle, log_metrics, numeric


def peak_memory_mb() -> float:
    """Peak GPU memory allocated, or the process's peak resident memory on CPU."""
    import resource

    import torch

    if torch.cuda.is_available():
        return round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)

log = logging.getLogger("llmops.train")


class MetricsCallback(TrainerCallback):
    """Logs loss, eval loss, learning rate, grad norm, real (non-pad) tokens/s and padding as training goes."""

    def __init__(self, run: RunHandle | None, prefix: str, padding: Any = None) -> None:
        self.run, self.prefix, self.padding = run, prefix, padding
        self.last_tokens, self.last_time = 0, time.perf_counter()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.last_tokens, self.last_time = state.num_input_tokens_seen, time.perf_counter()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        values = numeric(logs or {})
        now = time.perf_counter()
        if "loss" in values and state.num_input_tokens_seen and now > self.last_time:
            values["tokens_per_s"] = (state.num_input_tokens_seen - self.last_tokens) / (now - self.last_time)
            self.last_tokens, self.last_time = state.num_input_tokens_seen, now
        if "loss" in values and self.padding is not None:
            values["padding_fraction"] = self.padding.padding_fraction()
            values["peak_memory_mb"] = peak_memory_mb()
        if "loss" in values:
            log.info("step %d/%d  loss %.4f  %.0f tokens/s", state.global_step, state.max_steps, values["loss"],
                     values.get("tokens_per_s", 0.0))
        if self.run is not None and values:
            log_metrics(self.run.tracking, self.run.run_id, {f"{self.prefix}.{k}": v for k, v in values.items()},
                        step=state.global_step)
