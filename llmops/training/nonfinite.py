"""A step whose gradient norm is NaN or infinite, seen at the step it happens: skipped, or the end of the training;
and a training whose loss ended far above where it started, stopped before its model is saved.

The gradient norm is the one the Trainer computes to clip the gradients (train.max_grad_norm), taken
as it returns; a NaN or infinite loss makes it non-finite too. A skipped step changes neither the
weights nor the optimizer's state (the learning-rate schedule goes on). Fused AdamW (the optimizer on
CUDA, train.speed.fused_adamw) skips a step on the device when a flag says so, as under a loss scaler:
the flag is set on the device, and the count is read only where figures are read (a log, a checkpoint,
an evaluation, the end), so no step waits for the host; from the step past the limit every update is
skipped, and the training stops at the next reading, naming that step. Any other optimizer steps
unless the host stops it: then that one number is read at each optimizer step, before the update, and
the gradients are dropped. The count is logged as `train/nonfinite_steps` with the other figures.

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
    """The training diverged: a non-finite gradient norm more often than train.nonfinite allows, or a loss that
    ended far above where it started."""


class NonfiniteGuard(TrainerCallback):
    """Skips or stops at a non-finite gradient norm, by train.nonfinite; counts those steps."""

    def __init__(self, policy: NonfiniteConfig, run: RunHandle | None, loss_falls: bool = True) -> None:
        self.policy, self.run, self.loss_falls = policy, run, loss_falls
        self.steps = 0
        self.norm: Any = None
        self.last_checkpoint: Path | None = None
        self.on_device: DeviceTally | None = None

    @property
    def limit(self) -> int:
        """Non-finite steps allowed; one more stops the training."""
        return 0 if self.policy.action == "stop" else self.policy.max_skips

    def attach(self, trainer: Any) -> None:
        """Keep each gradient norm `trainer` computes to clip its gradients, for this trainer alone; nothing under a
        loss scaler or DeepSpeed (above)."""
        if trainer.args.fp16 or trainer.is_deepspeed_enabled:
            return
        clip = trainer._clip_grad_norm

        def clipped(model: Any) -> Any:
            norm = clip(model)
            # FSDP2 gives a DTensor: the whole norm, a plain tensor, is what the device-side flag is made of
            self.norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            return norm

        trainer._clip_grad_norm = clipped

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step:  # resumed from that checkpoint
            self.last_checkpoint = checkpoint_folder(args, state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # the first step's loss is the starting point the end is measured against (kept in every checkpoint's history)
        if state.global_step == 1:
            control.should_log = True
        # the device's count is read where figures are read: before a log, a checkpoint, an evaluation or the end
        if control.should_log or control.should_save or control.should_evaluate or control.should_training_stop:
            self.settle(state)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """A training whose loss ends far above where it started has diverged: its model goes no further."""
        self.settle(state)
        problem = divergence([entry for entry in state.log_history if "loss" in entry]) if self.loss_falls else None
        if problem:
            raise DivergedError(f"training diverged: {problem}; lower train.learning_rate or raise train.warmup_ratio")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.last_checkpoint = checkpoint_folder(args, state.global_step)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        norm, self.norm = self.norm, None
        step = state.global_step + 1  # the step being taken
        optimizer = getattr(kwargs.get("optimizer"), "optimizer", kwargs.get("optimizer"))  # accelerate's wraps it
        if norm is not None and skips_on_device(optimizer, norm):
            self.on_device = self.on_device or DeviceTally(norm.device)
            self.on_device.decide(norm, step, optimizer, self.limit)
            return
        value = read(norm)
        if value is None or math.isfinite(value):
            return
        self.steps += 1
        drop_gradients(kwargs["model"])
        if self.steps > self.limit:
            self.send(step, state, value)
            raise DivergedError(self.stop_message(step, value))
        log.warning(
            "step %d: gradient norm %s, the update is skipped (%d of train.nonfinite.max_skips %d)",
            step,
            value,
            self.steps,
            self.policy.max_skips,
        )

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        optimizer = getattr(kwargs.get("optimizer"), "optimizer", kwargs.get("optimizer"))
        if self.on_device is not None and hasattr(optimizer, "found_inf"):
            del optimizer.found_inf

    def settle(self, state: Any) -> None:
        """The device's count, read: its skipped steps said, and the training stopped at the step past the limit."""
        if self.on_device is None:
            return
        total, stop_step, stop_norm = self.on_device.read()
        if total > self.steps:
            log.warning(
                "%d more steps with a non-finite gradient norm by step %d, their updates skipped (%d in all, "
                "train.nonfinite.max_skips %d)",
                total - self.steps,
                state.global_step,
                total,
                self.policy.max_skips,
            )
        self.steps = total
        if stop_step:
            self.send(stop_step, state, stop_norm)
            raise DivergedError(self.stop_message(stop_step, stop_norm))

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


def skips_on_device(optimizer: Any, norm: Any) -> bool:
    """Whether the optimizer skips its step itself when told to on the device (fused AdamW reads a found_inf flag,
    as a loss scaler sets it): then no number needs to reach the host at each step."""
    import torch

    return isinstance(norm, torch.Tensor) and bool(getattr(optimizer, "_step_supports_amp_scaling", False))


class DeviceTally:
    """The non-finite steps counted on the device: how many, the step that went past the limit and its norm.

    From that step on every update is skipped (its flag stays up), so the weights stay those of the
    step before it until the count is read and the training stopped.
    """

    def __init__(self, device: Any) -> None:
        import torch

        self.figures = torch.zeros(3, device=device)  # count, the stopping step (0: none), its norm

    def decide(self, norm: Any, step: int, optimizer: Any, limit: int) -> None:
        import torch

        bad = (~torch.isfinite(norm)).float()
        count = self.figures[0] + bad
        stopping = (count > limit).float()
        first = stopping * (self.figures[1] == 0).float()
        self.figures = torch.stack(
            [count, self.figures[1] + first * step, torch.where(first > 0, norm.float(), self.figures[2])]
        )
        optimizer.found_inf = torch.maximum(bad, stopping)  # a scalar, as the step counts it is taken from

    def read(self) -> tuple[int, int, float]:
        count, step, norm = self.figures.tolist()
        return int(count), int(step), norm


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
