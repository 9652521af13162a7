"""The `train.speed` section: the training speed levers, each a switch the GPU bench can compare.

`auto` is the fast choice on CUDA where it is safe and off on CPU (where none of them pays); what
`auto` becomes is decided with the launch plan (training/speed.py), so it follows the machine the
training runs on. They shape the weights only within floating-point noise, but they do change them:
they are part of the train stage's key.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from llmops.config.section import Section

Switch = Literal["auto", "on", "off"]


class SpeedConfig(Section):
    # torch.compile: each decoder layer (layers: one graph every layer reuses, a short compile), the whole model
    # (model) or nothing (none); auto: layers on CUDA in one process or DDP (not on a 4-bit base), none on CPU
    compile: Literal["auto", "layers", "model", "none"] = "auto"
    # Liger's Triton kernels (RMSNorm, SwiGLU, RoPE, and a fused linear cross-entropy that never holds the
    # full-vocabulary logits) through the Trainer's use_liger_kernel; auto: on CUDA when liger-kernel is installed;
    # on: required (a run without it stops in one line)
    liger_kernel: Switch = "auto"
    # AdamW as one fused kernel over all parameters; auto: on CUDA (DeepSpeed's own optimizer, where its file names
    # one, is used instead)
    fused_adamw: Switch = "auto"
    # packed training: tokens per micro-batch per device, as many max_length rows as fit (at least one) instead of
    # train.batch_size rows; None: train.batch_size rows (unpacked training always uses train.batch_size)
    micro_batch_tokens: int | None = Field(None, ge=1)
    # processes that collate batches beside each training process (the DataLoader's workers; 0: the training process
    # collates them itself, between steps), with pinned memory and workers kept across epochs on CUDA; auto: on CUDA,
    # up to 4 per training process (fewer where the machine's cores are shared by more), 0 on CPU. What a training
    # makes is the same whatever their number (only masked-LM masks are drawn per worker)
    loader_workers: Literal["auto"] | int = "auto"

    @field_validator("loader_workers")
    @classmethod
    def workers_in_range(cls, value: str | int) -> str | int:
        if isinstance(value, int) and not 0 <= value <= 64:
            raise ValueError("loader_workers: expected auto or 0 to 64")
        return value
