"""The figures a run's MLflow page is said to hold, on a real training: the learning-rate curve the schedule
gives, the Trainer's steps/s and samples/s, MLflow's system metrics (CPU and memory here, and GPU utilisation and
memory through an NVML that answers as one GPU would: there is none on this machine), and the dataset card's
counts of what was planted in the data."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from llmops.data.synthetic import instruction_records
from llmops.pipeline.runner import run_chain
from llmops.tracking import log as tracking
from llmops.tracking import runs
from tests.conftest import tiny_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]
STEPS = 40


def fake_nvml() -> types.ModuleType:
    """NVML as it answers for one GPU: 73% busy, 2 GB of 8 GB used, 150 W of 300 W."""
    nvml = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    nvml.NVMLError = NVMLError
    nvml.nvmlInit = lambda: None
    nvml.nvmlShutdown = lambda: None
    nvml.nvmlDeviceGetCount = lambda: 1
    nvml.nvmlDeviceGetHandleByIndex = lambda index: f"gpu-{index}"
    nvml.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(used=2e9, total=8e9, free=6e9)
    nvml.nvmlDeviceGetUtilizationRates = lambda handle: types.SimpleNamespace(gpu=73, memory=40)
    nvml.nvmlDeviceGetPowerUsage = lambda handle: 150_000
    nvml.nvmlDeviceGetEnforcedPowerLimit = lambda handle: 300_000
    return nvml


@pytest.fixture
def data(tmp_path: Path) -> Path:
    """300 instructions, then 4 of them again (exact duplicates) and 2 broken rows."""
    rows = [json.dumps(row) for row in instruction_records(rows=300, seed=5)]
    path = tmp_path / "planted.jsonl"
    path.write_text("\n".join([*rows, *rows[:4], '{"instruction": "cut', '{"instruction": "", "output": ""}']) + "\n")
    return path


@pytest.fixture
def trained_run(data: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    from mlflow.system_metrics.metrics import gpu_monitor

    nvml = fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(gpu_monitor, "pynvml", nvml, raising=False)
    config = tiny_config("tiny_sft_cpu.yaml", data, f"train.max_steps={STEPS}", "train.logging_steps=5")
    with runs.pipeline_run(config, "observed", {}) as run:
        records = run_chain(config, run, through="train")
    mlflow_client = tracking.client(config.tracking)
    return {"config": config, "records": records, "client": mlflow_client, "run": mlflow_client.get_run(run.run_id)}


def test_a_training_run_holds_the_figures_the_readme_names(trained_run: dict[str, Any]) -> None:
    from transformers import get_scheduler

    config, records, client, run = (trained_run[k] for k in ("config", "records", "client", "run"))
    metrics, run_id = run.data.metrics, run.info.run_id
    # the learning rate of each logged step, as the cosine schedule with warm-up sets it
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=config.train.learning_rate)
    schedule = get_scheduler("cosine", optimizer, num_warmup_steps=2, num_training_steps=STEPS)  # ceil(5% of 40)
    rates = []
    for _ in range(STEPS):
        rates.append(schedule.get_last_lr()[0])
        schedule.step()
    logged = {m.step: m.value for m in client.get_metric_history(run_id, "train/learning_rate")}
    assert sorted(logged) == [1, *range(5, STEPS + 1, 5)]
    assert logged == {step: pytest.approx(rates[step - 1], rel=1e-6) for step in logged}
    # the Trainer's speed over the whole training: steps/s and samples/s of one runtime
    arguments = json.loads((records["train"].dir / "model" / "training_args.json").read_text())
    per_step = arguments["per_device_train_batch_size"] * arguments["gradient_accumulation_steps"]
    runtime = metrics["train/train_runtime"]
    assert metrics["train/train_steps_per_second"] * runtime == pytest.approx(STEPS, rel=0.02)
    assert metrics["train/train_samples_per_second"] * runtime == pytest.approx(STEPS * per_step, rel=0.02)
    # MLflow's system metrics while training: the machine's, and the GPU's as NVML reports them
    assert 0 <= metrics["system/cpu_utilization_percentage"] <= 100
    assert metrics["system/system_memory_usage_megabytes"] > 0
    assert metrics["system/gpu_0_utilization_percentage"] == 73
    assert metrics["system/gpu_0_memory_usage_megabytes"] == 2000
    assert metrics["system/gpu_0_memory_usage_percentage"] == 25
    # the dataset card: what was planted, counted as the stages counted it, and logged with the run
    card = (records["report"].dir / "dataset_card.md").read_text()
    report = records["report"].figures
    assert (report.rows_read, report.rows_quarantined) == (306, 2) and report.duplicates >= 4
    assert f"| {report.rows_read} | 2 | {report.duplicates} | {report.near_duplicates} |" in card
    assert f"| {report.train_rows} | {report.eval_rows} |" in card
    assert (
        "2 rows were quarantined: " in card and f"{report.duplicates + report.near_duplicates} duplicate rows" in card
    )
    assert f"Record kind: **instruction** · license: **{config.data.license}**" in card
    assert f"Training sees {report.train_samples} samples" in card and f"{report.train_tokens} tokens" in card
    logged_files = {Path(found.path).name for found in client.list_artifacts(run_id, "data")}
    assert "dataset_card.md" in logged_files
