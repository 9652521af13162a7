"""Faults met while training, counted and logged as `train/<figure>`: a checkpoint save that fails, a batch that
cannot be collated, running out of memory (its error still ends the training). A real Trainer loop on a two-weight
model; the disk and data faults are real, out of memory (no GPU here) is raised by the model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Trainer, TrainingArguments

from llmops.training.faults import DATA_ERRORS, OOM_EVENTS, SAVE_FAILURES, FaultCounter


class Tiny(torch.nn.Module):
    def __init__(self, out_of_memory_at: int = 0) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor([0.5, -0.5]))
        self.out_of_memory_at, self.calls = out_of_memory_at, 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        self.calls += 1
        if self.calls == self.out_of_memory_at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return {"loss": ((x @ self.weight - y) ** 2).mean()}


def row(width: int = 2) -> dict[str, torch.Tensor]:
    return {"x": torch.ones(width), "y": torch.tensor(3.0)}


def trained(folder: Path, counter: FaultCounter, rows: list[dict[str, Any]], model: Tiny | None = None) -> Trainer:
    arguments = TrainingArguments(
        output_dir=str(folder),
        max_steps=6,
        per_device_train_batch_size=2,
        logging_steps=1,
        save_steps=2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model or Tiny(), args=arguments, train_dataset=rows, callbacks=[counter])
    counter.attach(trainer)
    trainer.train()
    return trainer


def test_a_checkpoint_that_cannot_be_written_is_counted(tmp_path: Path) -> None:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "checkpoint-4").write_text("a file where the checkpoint's folder goes")
    counter = FaultCounter(run=None)
    with pytest.raises(OSError):
        trained(tmp_path, counter, [row() for _ in range(16)])
    assert counter.counts == {SAVE_FAILURES: 1, DATA_ERRORS: 0, OOM_EVENTS: 0}
    assert (tmp_path / "checkpoint-2").is_dir()  # the save before it went through


def test_a_checkpoint_that_cannot_be_copied_to_the_store_is_counted(tmp_path: Path) -> None:
    from llmops.training.callbacks import CheckpointCallback
    from llmops.training.checkpoints import CheckpointStoreError

    (tmp_path / "store").write_text("a file where the checkpoint store's folder goes")
    counter = FaultCounter(run=None)
    rows = [row() for _ in range(16)]
    arguments = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=4,
        per_device_train_batch_size=2,
        save_steps=2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    store = CheckpointCallback(str(tmp_path / "store" / "checkpoints"), key="k")
    trainer = Trainer(model=Tiny(), args=arguments, train_dataset=rows, callbacks=[counter, store])
    counter.attach(trainer)
    with pytest.raises(CheckpointStoreError, match="Not a directory"):
        trainer.train()
    assert counter.counts == {SAVE_FAILURES: 1, DATA_ERRORS: 0, OOM_EVENTS: 0}
    assert (tmp_path / "out" / "checkpoint-2").is_dir()  # written here: the copy is what failed


def test_a_batch_that_cannot_be_collated_is_counted(tmp_path: Path) -> None:
    counter = FaultCounter(run=None)
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        trained(tmp_path, counter, [row() for _ in range(3)] + [row(width=3)] * 13)
    assert counter.counts == {SAVE_FAILURES: 0, DATA_ERRORS: 1, OOM_EVENTS: 0}


def test_out_of_memory_is_counted_and_logged_and_a_clean_training_logs_zeros(tmp_path: Path) -> None:
    from llmops.config.schema import TrackingConfig
    from llmops.tracking import log as tracking
    from llmops.tracking.log import RunHandle

    config = TrackingConfig()
    mlflow_client = tracking.client(config)
    failed, clean = (mlflow_client.create_run(tracking.experiment_id(config)).info.run_id for _ in range(2))
    counter = FaultCounter(RunHandle(tracking=config, run_id=failed))
    with pytest.raises(torch.OutOfMemoryError):
        trained(tmp_path / "a", counter, [row() for _ in range(16)], Tiny(out_of_memory_at=3))
    (logged,) = mlflow_client.get_metric_history(failed, "train/oom_events")
    assert (logged.value, logged.step) == (1.0, 2)  # during the third step, after two
    trained(tmp_path / "b", FaultCounter(RunHandle(tracking=config, run_id=clean)), [row() for _ in range(16)])
    metrics = mlflow_client.get_run(clean).data.metrics
    assert {name: metrics[f"train/{name}"] for name in (SAVE_FAILURES, DATA_ERRORS, OOM_EVENTS)} == dict.fromkeys(
        (SAVE_FAILURES, DATA_ERRORS, OOM_EVENTS), 0.0
    )
    assert {m.step for m in mlflow_client.get_metric_history(clean, "train/data_errors")} == {6}


def test_the_run_logs_its_duration_however_it_ends(sft_config: Any) -> None:
    import time

    from llmops.tracking import log as tracking
    from llmops.tracking import runs

    def timed(fails: bool) -> Any:
        handles: list[Any] = []
        try:
            with runs.pipeline_run(sft_config, "timed", {}) as run:
                handles.append(run)
                time.sleep(0.3)
                if fails:
                    raise ValueError("bad row")
        except ValueError:
            assert fails
        return tracking.client(sft_config.tracking).get_run(handles[0].run_id)

    for fails, status in ((False, "FINISHED"), (True, "FAILED")):
        found = timed(fails)
        assert found.info.status == status
        assert 0.3 <= found.data.metrics["run/seconds"] < 30
