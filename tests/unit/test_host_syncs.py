"""No host sync on every training step: the Trainer's NaN filter is off, and a stop request is agreed between
processes every few steps only. The collectives are counted where they are called (no process group or GPU here);
the SFT trainer's figures: tests/integration/test_sft_host_syncs.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerControl, TrainerState

from llmops.config.schema import TrainConfig
from llmops.training.callbacks import StopOnSignal
from llmops.training.launch import LaunchPlan
from llmops.training.trainer import common_arguments

CPU = LaunchPlan("none", 1, 1, "cpu")


def test_the_trainers_nan_filter_is_off(tmp_path: Path) -> None:
    assert common_arguments(TrainConfig(), tmp_path, packed=False, plan=CPU)["logging_nan_inf_filter"] is False


def steps_until_stop(callback: StopOnSignal, world_size: int, requested_at: int,
                     monkeypatch: pytest.MonkeyPatch) -> tuple[int | None, list[int]]:
    """Run the callback over 40 steps, a stop requested at `requested_at`: the step it stopped at, and the steps
    at which the processes agreed (an all-reduce each)."""
    agreed: list[int] = []
    state, args = TrainerState(max_steps=40), SimpleNamespace(world_size=world_size, device="cpu")

    def reduce(tensor: torch.Tensor, reduction: str) -> torch.Tensor:
        agreed.append(state.global_step)
        return tensor * world_size

    monkeypatch.setattr("accelerate.utils.reduce", reduce)
    for step in range(1, 41):
        state.global_step = step
        if step == requested_at:
            callback.requested.set()
        control = TrainerControl()
        callback.on_step_end(args, state, control)
        if control.should_training_stop:
            assert control.should_save
            return step, agreed
    return None, agreed


def test_several_processes_agree_on_a_stop_every_n_steps_only(monkeypatch: pytest.MonkeyPatch) -> None:
    stopped, agreed = steps_until_stop(StopOnSignal(every=10), world_size=2, requested_at=12, monkeypatch=monkeypatch)
    assert agreed == [10, 20] and stopped == 20


def test_one_process_stops_at_the_step_it_was_asked_without_a_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    stopped, agreed = steps_until_stop(StopOnSignal(every=10), world_size=1, requested_at=12, monkeypatch=monkeypatch)
    assert agreed == [] and stopped == 12
