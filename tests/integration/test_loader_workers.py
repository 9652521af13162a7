"""Batches collated in loader worker processes train the same: a training on CPU with two loader workers writes the
same ledger (which samples each step trained on, what a resumed training skips), counts the same tokens and reports
the same figures as one that collates in its own process, and resumes skipping exactly what its ledger lists."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def tokenized_texts() -> Any:
    """A tokenize-stage artifact of random ids and varied lengths, as the GPU bench makes it."""
    sys.path.insert(0, str(REPO / "bench"))
    from gpu_train_bench import lengths, synthetic_tokenized

    return synthetic_tokenized("workers", 64, lengths(120, 10, 0.6, 32), 32)


def trained(workers: int, steps: int, folder: Path, tokenized: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A packed training of `steps` steps into `folder` (resuming from a checkpoint there): its figures and ledger."""
    from llmops.config.schema import PipelineConfig
    from llmops.pipeline.stages import StageContext
    from llmops.training.train import train

    config = PipelineConfig.model_validate({
        "data": {"kind": "text"}, "tokenize": {"max_length": 32},
        "model": {"architecture": "llama", "hidden_size": 32, "num_layers": 2, "num_heads": 2,
                  "intermediate_size": 64},
        "train": {"max_steps": steps, "batch_size": 2, "grad_accum": 2, "save_steps": 100, "logging_steps": 1,
                  "lr_scheduler": "constant", "warmup_ratio": 0.0, "speed": {"loader_workers": workers}}})
    figures = train(config, tokenized, StageContext(folder=folder)).model_dump()
    ledger = [json.loads(line) for line in (folder / "ledger" / "rank-0.jsonl").read_text().splitlines()]
    return figures, ledger


def compared(figures: dict[str, Any]) -> dict[str, Any]:
    """The figures that say what was trained on and how it went (not the clock, nor the memory)."""
    return {name: figures[name] for name in ("steps", "epochs", "tokens", "padding_fraction", "attention_length",
                                             "flops_per_token", "train_loss", "first_logged_loss", "last_logged_loss",
                                             "resumed_from_step", "packed")}


def stopping_at(step: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainings stop at `step` as on SIGINT: with a checkpoint there, to be resumed."""
    from llmops.training.callbacks import StopOnSignal

    original = StopOnSignal.on_step_end

    def on_step_end(self: StopOnSignal, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step == step:
            self.requested.set()  # what the signal's handler does
        return original(self, args, state, control, **kwargs)

    monkeypatch.setattr(StopOnSignal, "on_step_end", on_step_end)


@pytest.mark.slow
def test_two_loader_workers_train_on_the_same_samples_with_the_same_figures(tmp_path: Path) -> None:
    from llmops.training.launch import TrainingInterrupted

    tokenized = tokenized_texts()
    alone, workers = trained(0, 4, tmp_path / "alone", tokenized), trained(2, 4, tmp_path / "workers", tokenized)
    assert compared(workers[0]) == compared(alone[0]) and workers[1] == alone[1]
    figures, ledger = workers
    assert figures["packed"] and figures["tokens"] > 0 and 0 < figures["padding_fraction"] < 1
    assert [entry["step"] for entry in ledger] == list(range(1, 5))
    samples = [sample for entry in ledger for sample in entry["samples"]]
    assert all(entry["samples"] for entry in ledger) and len(samples) == len(set(samples))  # each once, in one epoch
    # stopped at step 2 and resumed, with workers: the resumed run skips exactly the batches the ledger lists
    with pytest.MonkeyPatch.context() as patch, pytest.raises(TrainingInterrupted):
        stopping_at(2, patch)
        trained(2, 4, tmp_path / "resumed", tokenized)
    resumed, resumed_ledger = trained(2, 4, tmp_path / "resumed", tokenized)
    assert resumed["resumed_from_step"] == 2 and resumed_ledger == alone[1]
    for name in ("steps", "tokens", "train_loss", "last_logged_loss"):
        assert resumed[name] == alone[0][name], name
