"""Batches are collated in DataLoader worker processes (train.speed.loader_workers: auto is a few per training process
on CUDA, none on CPU), each carrying its own figures to the training process; and Liger's auto stays off where
liger-kernel is absent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from llmops.config.schema import TrainConfig
from llmops.io.errors import UserError
from llmops.text.packing import FIGURES, BatchMeter, PackedRows
from llmops.training import speed
from llmops.training.launch import LaunchPlan
from llmops.training.tally import Tally
from llmops.training.trainer import common_arguments


def loader_arguments(config: TrainConfig, plan: LaunchPlan, folder: Path) -> tuple[int, bool, bool]:
    arguments = common_arguments(config, folder, packed=True, plan=plan, row_length=64)
    return (arguments["dataloader_num_workers"], arguments["dataloader_pin_memory"],
            arguments["dataloader_persistent_workers"])


def test_auto_is_a_few_workers_per_process_on_cuda_and_none_on_cpu(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(speed.os, "cpu_count", lambda: 16)  # a GPU machine's cores
    assert loader_arguments(TrainConfig(), LaunchPlan("none", 1, 1, "cuda"), tmp_path) == (4, True, True)
    # 8 processes on 16 cores: one worker each, a core left to each process
    assert loader_arguments(TrainConfig(), LaunchPlan("ddp", 8, 1, "cuda"), tmp_path) == (1, True, True)
    assert loader_arguments(TrainConfig(), LaunchPlan("ddp", 2, 1, "cpu"), tmp_path) == (0, False, False)
    monkeypatch.setattr(speed.os, "cpu_count", lambda: None)  # unknown: still one worker on CUDA
    assert speed.resolve(TrainConfig(), "cuda", "none").loader_workers == 1


def test_workers_are_a_switch_on_either_device(tmp_path: Path) -> None:
    two, none = (TrainConfig.model_validate({"speed": {"loader_workers": n}}) for n in (2, 0))
    assert loader_arguments(two, LaunchPlan("none", 1, 1, "cpu"), tmp_path) == (2, False, False)
    assert loader_arguments(none, LaunchPlan("none", 1, 1, "cuda"), tmp_path) == (0, True, False)
    for wrong in (-1, "many"):
        with pytest.raises(ValidationError):
            TrainConfig.model_validate({"speed": {"loader_workers": wrong}})


def figures_through(workers: int) -> tuple[list[list[int]], int, int, float | None]:
    """Packed rows through a real DataLoader with `workers` processes, drawn and trained on in this one."""
    rows = [{"input_ids": list(range(1, n + 1)), "labels": list(range(1, n + 1)), "seq_lengths": [n - 1, 1],
             "sample_ids": [index] * (n - 1) + [index + 100]} for index, n in enumerate((3, 5, 8, 2, 6, 7, 4))]
    tally = Tally(BatchMeter(PackedRows(pad_token_id=0)))
    loader = torch.utils.data.DataLoader(rows, batch_size=2, collate_fn=tally.meter, num_workers=workers)
    taken = []
    for batch in loader:
        tally.draw(batch)
        assert FIGURES not in batch and set(batch) == {"input_ids", "labels", "position_ids"}
        taken.append(tally.take_ids())
    return taken, tally.used_tokens, tally.slots, tally.attention_length()


def test_batches_collated_in_worker_processes_carry_the_same_figures() -> None:
    alone = figures_through(0)
    assert alone[0] == [[0, 100, 1, 101], [2, 102, 3, 103], [4, 104, 5, 105], [6, 106]]
    # real tokens; slots: each batch padded to its longest row; Σ L² / Σ L over the samples (n - 1 and 1 a row)
    assert alone[1:] == (35, 2 * 5 + 2 * 8 + 2 * 7 + 4, pytest.approx((4 + 16 + 49 + 1 + 25 + 36 + 9 + 7) / 35))
    assert figures_through(2) == alone


def test_liger_auto_is_off_without_the_package_and_on_asks_for_it_in_one_line() -> None:
    if speed.liger_installed():
        pytest.skip("liger-kernel is installed here")
    assert speed.resolve(TrainConfig(), "cuda", "none").liger_kernel is False
    with pytest.raises(UserError) as stopped:
        speed.resolve(TrainConfig.model_validate({"speed": {"liger_kernel": "on"}}), "cuda", "none")
    assert "pip install liger-kernel" in str(stopped.value) and "\n" not in str(stopped.value)
