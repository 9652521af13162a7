"""What a training is and leaves behind: its figures, and what each training process needs besides the config."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from llmops.io.figures import Figures
from llmops.store.artifacts import StageRecord
from llmops.tracking.log import RunHandle

# files of a training folder: the spec each launched process reads, the figures rank 0 writes, the stop notice
SPEC_FILE, FIGURES_FILE, INTERRUPTED_FILE = "launch-spec.json", "figures.json", "interrupted.json"


class TrainFigures(Figures):
    steps: int
    epochs: float
    # the mean loss over every optimizer step, read from the log history (a resumed training included)
    train_loss: float
    first_logged_loss: float | None
    last_logged_loss: float | None
    best_eval_loss: float | None
    tokens: int
    seconds: float
    # real (non-pad) tokens per second over all processes, after the first steps (warm-up, compilation)
    tokens_per_s: float
    parameters: int
    trainable_parameters: int
    packed: bool
    padding_fraction: float
    peak_memory_mb: float
    strategy: str
    world_size: int
    # the step this run resumed from (0: from the start)
    resumed_from_step: int
    # model FLOPs per token, 6·N_trained + 4·N_frozen + 12·L·d·T (training/throughput.py), with T this attention
    # length per sample
    flops_per_token: float
    attention_length: float | None = None
    tflops_per_device: float
    # the card's dense bf16 peak MFU is measured against; None where it is unknown (and on CPU)
    peak_tflops: float | None = None
    # None where the card's peak is unknown (and on CPU)
    mfu: float | None
    # what the training computed in (bf16, fp16, fp32), and the dtypes its trainable and frozen weights were kept in
    precision: str | None = None
    trainable_dtype: str | None = None
    frozen_dtype: str | None = None


TrainRecord = StageRecord[TrainFigures]


class Session(BaseModel):
    """What every training process needs to know besides the config: where, which run, from which checkpoint."""

    folder: str
    key: str
    run: RunHandle | None = None
    resume_from: str | None = None
    plan: dict[str, Any]
