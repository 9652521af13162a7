"""A step whose gradient norm is NaN or infinite, seen at the step it happens: skipped, or the end of the training;
and a training whose loss ended far above where it started, stopped before its model is saved.

The gradient norm is the one the Trainer computes to clip the gradients (train.max_grad_norm), taken
as it returns; a NaN or infinite loss makes it non-finite too. Whether the optimizer may step is a
decision of the host, so this reads that one number once per optimizer step, after the backward pass
and before the update, where the update's kernels wait for it anyway. A skipped step drops the
gradients, so the optimizer changes neither the weights nor its own state (the learning-rate schedule
goes on). The count is logged as `train/nonfinite_steps` with the other figures.

A diverged training need not reach NaN (a learning rate of 10 keeps the loss finite, in the thousands):
its loss ends above twice the first step's, which is logged for that. Such a training ends in one line
before its model is saved, so it is never evaluated or registered. An objective whose loss does not
start high and come down (GRPO's starts near zero) says so with a class attribute `loss_falls = False`.

Not watched: fp16 with a loss scaler, which skips overflowing steps itself and lowers its scale (an
overflow there is routine, not a divergence), and DeepSpeed, whose engine clips and steps on its own.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from llmops.config.nonfinite import NonfiniteConfig
from llmops.io.errors import UserError
from llmops.tracking.log import RunHandle, log_metrics, metric_name

log = logging.getLogger("llmops.train")
FIGURE = "nonfinite_steps"
# a loss that ends above this many times its first step's has diverged (a loss that comes down never gets there)
RISE = 2.0


class DivergedError(UserError, RuntimeError):
    """The training produced a non-finite gradient norm more often than train.nonfinite allows."""


class NonfiniteGuard(TrainerCallback):
    """Skips or stops at a non-finite gradient norm, by train.nonfinite; counts those steps."""

    def __init__(self, policy: NonfiniteConfig, run: RunHandle | None, loss_falls: bool = True) -> None:
        self.policy, self.run, self.loss_falls = policy, run, loss_falls
        self.steps = 0
        self.norm: Any = None
        self.last_checkpoint: Path | None = None

    def attach(self, trainer: Any) -> None:
        """Keep each gradient norm `trainer` computes to clip its gradients, for this trainer alone; nothing under a
        loss scaler or DeepSpeed (above)."""
        if trainer.args.fp16 or trainer.is_deepspeed_enabled:
            return
        clip = trainer._clip_grad_norm

        def clipped(model: Any) -> Any:
            self.norm = clip(model)
            return self.norm

        trainer._clip_grad_norm = clipped

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step:  # resumed from that checkpoint
            self.last_checkpoint = checkpoint_folder(args, state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # the first step's loss is the starting point the end is measured against (kept in every checkpoint's history)
        if state.global_step == 1:
            control.should_log = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """A training whose loss ends far above where it started has diverged: its model goes no further."""
        problem = divergence([entry for entry in state.log_history if "loss" in entry]) if self.loss_falls else None
        if problem:
            raise DivergedError(f"training diverged: {problem}; lower train.learning_rate or raise train.warmup_ratio")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.last_checkpoint = checkpoint_folder(args, state.global_step)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        norm, self.norm = self.norm, None
        value = read(norm)
        if value is None or math.isfinite(value):
            return
        step = state.global_step + 1  # the step being taken
        self.steps += 1
        drop_gradients(kwargs["model"])
        if self.policy.action == "stop" or self.steps > self.policy.max_skips:
            self.send(step, state, value)
            raise DivergedError(self.stop_message(step, value))
        log.warning(
            "step %d: gradient norm %s, the update is skipped (%d of train.nonfinite.max_skips %d)",
            step,
            value,
            self.steps,
            self.policy.max_skips,
        )

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        # sent with the step's other figures (MetricsCallback, after this one); the Trainer's history keeps its copy
        if logs is not None and "loss" in logs:
            logs[FIGURE] = self.steps

    def send(self, step: int, state: Any, norm: float) -> None:
        """The count and the norm at the step that stops the training: no log of the Trainer's follows it."""
        if self.run is not None and state.is_world_process_zero:
            figures = {metric_name("train", FIGURE): float(self.steps), metric_name("train", "grad_norm"): norm}
            log_metrics(self.run.tracking, self.run.run_id, figures, step=step)

    def stop_message(self, step: int, value: float) -> str:
        why = (
            "train.nonfinite.action is stop"
            if self.policy.action == "stop"
            else f"{self.steps} such steps, more than train.nonfinite.max_skips {self.policy.max_skips}"
        )
        kept = (
            f"the last good checkpoint, kept, is {self.last_checkpoint}"
            if self.last_checkpoint
            else "no checkpoint was saved before it"
        )
        return (
            f"training stopped at step {step}: the gradient norm is {value} ({why}); {kept}; lower "
            "train.learning_rate or raise train.warmup_ratio, and check the data of that step"
        )


def divergence(history: list[dict[str, Any]]) -> str | None:
    """What shows a diverged training in its logged losses (from its first step on): its last finite loss more than
    RISE times the first step's, or none finite after it; None when the loss came down, or was never logged."""
    if len(history) < 2 or history[0]["step"] != 1 or not math.isfinite(first := float(history[0]["loss"])):
        return None
    finite = [entry for entry in history[1:] if math.isfinite(float(entry["loss"]))]
    if not finite:
        return f"the loss is not finite after step 1 (up to step {history[-1]['step']})"
    last = finite[-1]
    if float(last["loss"]) > RISE * first:
        return f"the loss rose from {first:.4g} at step 1 to {float(last['loss']):.4g} at step {last['step']}"
    return None


def read(norm: Any) -> float | None:
    """The norm as a number on the host (the one read per step; None: the Trainer gave none)."""
    if norm is None:
        return None
    return float(norm.item()) if hasattr(norm, "item") else float(norm)


def drop_gradients(model: Any) -> None:
    """No gradient at all: the optimizer passes over every parameter, its moments and step counts untouched (zero
    gradients would still move the weights by the moments and the weight decay)."""
    for parameter in model.parameters():
        parameter.grad = None


def checkpoint_folder(args: Any, step: int) -> Path:
    return Path(args.output_dir) / f"checkpoint-{step}"
