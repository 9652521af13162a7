"""On a CUDA machine: DeepSpeed ZeRO-2 and ZeRO-3 and FSDP each train and register the small config with a model
that loads and generates; QLoRA trains; the throughput bench runs both shapes. Skipped without CUDA.

The pipeline test needs Prefect and MLflow, which a bare GPU machine lacks: it imports them itself and is skipped
without them, so that the others are still collected and run there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmops.data.synthetic import instruction_records
from llmops.io.files import write_jsonl

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
SMALL = ["train.max_steps=40", "train.batch_size=16", "train.logging_steps=10", "evaluate.max_examples=16",
         "evaluate.max_new_tokens=12", "model.hidden_size=128", "model.num_layers=2"]


@pytest.fixture
def data(tmp_path: Path) -> Path:
    write_jsonl(tmp_path / "d.jsonl", instruction_records(rows=800, seed=5))
    return tmp_path / "d.jsonl"


@pytest.mark.parametrize("strategy", [["train.distributed=deepspeed", "train.zero_stage=2"],
                                      ["train.distributed=deepspeed", "train.zero_stage=3"],
                                      ["train.distributed=fsdp"]], ids=["zero2", "zero3", "fsdp"])
def test_sharded_training_registers_a_model_that_generates(strategy: list[str], data: Path) -> None:
    pytest.importorskip("prefect")
    mlflow = pytest.importorskip("mlflow")
    import torch

    from llmops.flows.pipeline import training_pipeline
    from llmops.objectives import load_config
    from llmops.tracking.log import client

    overrides = [f"data.path={data}", *SMALL, *strategy, "train.processes=1",
                 f"register.model_name=gpu-{strategy[-1].split('=')[-1]}"]
    summary = training_pipeline("configs/tiny_sft_cpu.yaml", overrides)
    registration = summary["registration"]
    assert registration["version"] == "1"
    config = load_config("configs/tiny_sft_cpu.yaml", overrides)
    client(config.tracking)
    loaded = mlflow.transformers.load_model(f"models:/{config.registry.model_name}/1", return_type="components")
    ids = loaded["tokenizer"]("<|user|>\nWrite this number in words.\n\n42<|end|>\n<|assistant|>\n",
                              return_tensors="pt")
    out = loaded["model"].generate(**ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]
    assert registration["metrics"]["trained"]["perplexity"] < registration["metrics"]["untrained"]["perplexity"]
    assert torch.cuda.is_available()


def test_qlora_trains(pretrained_base: Path, data: Path) -> None:
    from llmops.objectives import load_config
    from tests.helpers import data_stages, stage

    config = load_config(REPO / "configs" / "tiny_sft_cpu.yaml", [f"data.path={data}", "model.adapter=qlora",
                                                                   f"model.name_or_path={pretrained_base}",
                                                                   "train.max_steps=30", "train.logging_steps=5"])
    _, tokenized = data_stages(config)
    figures = stage("train", config, tokenized).figures
    assert figures.last_logged_loss < figures.first_logged_loss
    assert figures.trainable_parameters < figures.parameters


def test_the_throughput_bench_reports_both_shapes(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "bench/gpu_train_bench.py"], cwd=REPO, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    # the progress lines printed while a shape trains aside, one line per shape
    shapes = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    shapes = [line for line in shapes if not line.get("progress")]
    (tmp_path / "gpu_bench.json").write_text(json.dumps(shapes, indent=2))
    assert [s["shape"] for s in shapes] == ["llama1b", "gpt2"]
    assert all(s["mfu"] is not None and s["tokens_per_s"] > 0 for s in shapes)
    # GPT-2 has no flex_attention: a varlen FlashAttention where installed, else sdpa with packed rows
    assert next(s for s in shapes if s["shape"] == "gpt2")["attention"] != "flex_attention"
