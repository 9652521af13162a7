"""Training controls and adapters through the registry (moved from tests/unit: they train models)."""

from pathlib import Path

import mlflow
import pytest
import torch

from llmops.config.schema import TrackingConfig
from llmops.data.lineage import Lineage
from llmops.data.versions import DataVersion
from llmops.models import modeling
from llmops.objectives import selected
from llmops.registry.register import register_model
from llmops.tracking import log as tracking
from llmops.tracking.log import RunHandle
from tests.conftest import tiny_config
from tests.helpers import data_stages, stage


@pytest.mark.slow
def test_lora_adapter_from_the_registry_gives_the_same_outputs(pretrained_base: Path, instruction_file: Path) -> None:
    config = tiny_config("tiny_sft_cpu.yaml", instruction_file, f"model.name_or_path={pretrained_base}",
                         "model.adapter=lora", "train.max_steps=20", "register.model_name=adapter",
                         "evaluate.primary_metric=completion_loss")
    ingested = stage("ingest", config)
    validated = stage("validate", config, ingested)
    deduped = stage("dedup", config, validated)
    tokenized = stage("tokenize", config, deduped)
    described = stage("report", config, ingested, validated, deduped, tokenized)
    trained = stage("train", config, tokenized)
    assert modeling.is_adapter(trained.dir / "model")
    assert not (trained.dir / "model" / "model.safetensors").exists()  # the adapter alone is saved
    evaluated = stage("evaluate", config, trained, tokenized, deduped)
    tracking_config = TrackingConfig()
    run_id = tracking.client(tracking_config).create_run(tracking.experiment_id(tracking_config)).info.run_id
    lineage = Lineage(git_commit="c", git_dirty=False, data=DataVersion(), data_sha256="d", config_hash="h",
                      flow_run_id="f")
    run = RunHandle(tracking=tracking_config, run_id=run_id)
    registration = register_model(config, run, trained, evaluated, described, lineage)
    assert registration.alias == "champion", registration.reason
    loaded = mlflow.transformers.load_model("models:/adapter@champion", return_type="components")
    before = selected(config.data).load_trained(trained.dir / "model").eval()
    after = loaded["model"].eval()
    ids = loaded["tokenizer"]("<|user|>\nWrite this number in words.\n\n42<|end|>\n", return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(after(**ids).logits, before(**ids).logits)


@pytest.mark.slow
def test_merged_lora_saves_full_weights_and_the_adapter(pretrained_base: Path, instruction_file: Path) -> None:
    config = tiny_config("tiny_sft_cpu.yaml", instruction_file, f"model.name_or_path={pretrained_base}",
                         "model.adapter=lora", "model.lora.merge=true", "train.max_steps=10")
    _, tokenized = data_stages(config)
    trained = stage("train", config, tokenized)
    assert (trained.dir / "model" / "model.safetensors").is_file()
    assert modeling.is_adapter(trained.dir / "adapter") and not modeling.is_adapter(trained.dir / "model")


@pytest.mark.slow
def test_early_stopping_on_eval_loss(instruction_file: Path) -> None:
    config = tiny_config("tiny_sft_cpu.yaml", instruction_file, "train.learning_rate=1e-9", "train.eval_steps=5",
                         "train.early_stopping_patience=2", "train.max_steps=200")
    _, tokenized = data_stages(config)
    stats = stage("train", config, tokenized).figures
    # evaluated every 5 steps; stopped once 2 evaluations in a row did not improve on the best
    assert stats.steps < 200 and stats.steps % 5 == 0
    assert stats.best_eval_loss is not None


@pytest.mark.slow
def test_gradient_checkpointing_and_accumulation_still_learn(instruction_file: Path) -> None:
    config = tiny_config("tiny_sft_cpu.yaml", instruction_file, "train.gradient_checkpointing=true",
                         "train.grad_accum=2", "train.batch_size=16", "train.max_steps=60")
    _, tokenized = data_stages(config)
    stats = stage("train", config, tokenized).figures
    assert stats.last_logged_loss < stats.first_logged_loss / 2


@pytest.mark.slow
def test_qlora_without_cuda_is_a_clear_error(pretrained_base: Path, instruction_file: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    config = tiny_config("tiny_sft_cpu.yaml", instruction_file, f"model.name_or_path={pretrained_base}",
                         "model.adapter=qlora")
    _, tokenized = data_stages(config)
    with pytest.raises(modeling.HardwareError, match="model.adapter=qlora needs a CUDA GPU"):
        stage("train", config, tokenized)


@pytest.mark.slow
def test_packing_falls_back_when_off(instruction_file: Path) -> None:
    config = tiny_config("tiny_sft_cpu.yaml", instruction_file, "train.packing=false", "train.group_by_length=true",
                         "train.max_steps=20")
    _, tokenized = data_stages(config)
    stats = stage("train", config, tokenized).figures
    assert not stats.packed and stats.padding_fraction > 0
