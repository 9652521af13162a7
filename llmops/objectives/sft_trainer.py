"""TRL's SFTTrainer without a host sync per step: its figures stay on the device until a logging step.

SFTTrainer's compute_loss reads its figures (the entropy, the token accuracy, the tokens seen) back
to the host at every micro-step (`.item()` after a gather over the processes), so the host waits
for the GPU's queue at every step. Where the loss is its plain one (the fused LM head's
log-probabilities: no custom loss function, label smoothing, MoE auxiliary loss or sequence
parallelism), the same loss is computed here and the figures are summed on the device; `log` reads
them once, summed over the processes. Entropy and accuracy are then means over the tokens since
the last log (TRL's: the mean of each micro-step's mean). On CPU the same figures come from the
model's own logits, which is faster there (LOGITS_BYTES).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import Trainer

    from llmops.objectives.base import Model

# what is summed on the device between logs: label tokens, entropy, correct top-1 predictions, input tokens
SUMS = ("valid", "entropy", "correct", "tokens")
# TRL's fused head keeps the (tokens x vocabulary) logits out of memory, which is what lets long rows fit on a GPU.
# Without Triton it folds its tiles in torch ops, and recomputes them in the backward: on CPU a step took 1.7-2x the
# time of one through the model's own logits (vocabularies of 600 to 32,000). So on CPU the logits are made, where
# they take at most this many bytes (their log-softmax and its gradient take as much again each)
LOGITS_BYTES = 256 << 20


@functools.cache
def sft_trainer_class() -> type:
    """SFTTrainer with its figures read at logging steps only (built on first use: importing TRL takes seconds)."""
    import torch
    from trl import SFTTrainer

    class SFTTrainerReadingAtLogs(SFTTrainer):
        pending: torch.Tensor | None = None

        def compute_loss(self, model: Model, inputs: Any, return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:
            if return_outputs or not self.model.training or not plain_loss(self):
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            inputs["use_cache"] = False
            outputs = (model(**inputs, fused_lm_head=True) if fused_head(self.model, inputs)
                       else plain_head(model, inputs))
            per_token_loss = -outputs.log_probs  # zero on ignored positions
            if self.args.loss_type == "dft":
                per_token_loss = per_token_loss * outputs.log_probs.exp().detach()
            num_tokens = outputs.label_mask.sum() if num_items_in_batch is None else num_items_in_batch
            loss = per_token_loss.sum() / torch.as_tensor(num_tokens).clamp(min=1)
            if self.args.average_tokens_across_devices and num_items_in_batch is not None:
                loss = loss * (self.accelerator.num_processes // self.get_tp_size())
            sums = step_sums(outputs, inputs)
            self.pending = sums if self.pending is None else self.pending + sums
            return loss

        def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
            if self.model.training and self.pending is not None:
                self.read_pending()
            super().log(logs, start_time)

        def read_pending(self) -> None:
            """The figures summed since the last log, over every process, read once into TRL's metrics."""
            sums = self.pending
            if self.accelerator.num_processes > 1:
                sums = self.accelerator.reduce(sums, reduction="sum")
            found = dict(zip(SUMS, sums.tolist(), strict=True))
            self.pending = None
            metrics, valid = self._metrics["train"], found["valid"]
            metrics["entropy"].append(found["entropy"] / valid if valid else 0.0)
            metrics["mean_token_accuracy"].append(found["correct"] / valid if valid else 0.0)
            self._total_train_tokens += int(found["tokens"]) // self._tp_size
            metrics["num_tokens"] = [self._total_train_tokens]

    return SFTTrainerReadingAtLogs


def plain_loss(trainer: Trainer) -> bool:
    """Whether SFTTrainer computes its plain loss (the fused LM head's), the only one computed here."""
    parallelism = getattr(trainer.accelerator, "parallelism_config", None)
    return (trainer.compute_loss_func is None and trainer.label_smoother is None and not trainer.aux_loss_enabled
            and not getattr(parallelism, "sp_enabled", False))


def fused_head(model: Model, inputs: dict[str, Any]) -> bool:
    """Whether this micro-step's loss goes through TRL's fused head rather than the model's logits."""
    ids = inputs["input_ids"]
    vocabulary = model.config.get_text_config().vocab_size
    return ids.device.type != "cpu" or "shift_labels" in inputs or ids.numel() * vocabulary * 4 > LOGITS_BYTES


def plain_head(model: Model, inputs: dict[str, Any]) -> Any:
    """The fused head's outputs (per label token: log-probability, entropy, top-1 hit; the label mask), computed from
    the model's logits. A label -100 is ignored; the labels are shifted here, as the fused head shifts them."""
    import torch

    logits = model(**{key: value for key, value in inputs.items() if key != "labels"}).logits[:, :-1].float()
    targets = inputs["labels"][:, 1:]
    mask = targets != -100
    log_softmax = torch.log_softmax(logits, dim=-1)
    chosen = log_softmax.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(log_softmax.exp() * log_softmax).sum(-1)
        top1 = logits.argmax(-1) == targets
    return SimpleNamespace(log_probs=chosen * mask, label_mask=mask, entropy=entropy * mask, is_top1=top1 & mask)


def step_sums(outputs: Any, inputs: dict[str, Any]) -> Any:
    """One micro-step's figures as one device tensor (float64: counts stay exact), in SUMS order."""
    import torch

    if "attention_mask" in inputs:
        tokens = inputs["attention_mask"].sum()
    else:  # padding-free rows: the flat sequence's length, as TRL counts it
        tokens = torch.tensor(inputs["position_ids"].size(1), device=inputs["position_ids"].device)
    parts = (outputs.label_mask.sum(), outputs.entropy.detach().sum(), outputs.is_top1.sum(), tokens)
    return torch.stack([part.to(torch.float64) for part in parts])
