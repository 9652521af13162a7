"""The speed levers reach the Trainer as configured (train.speed), auto being the fast choice with CUDA and off on
CPU; and packing asked for is packing, or one line (train.packing_fallback lets a run train unpacked instead). What
the levers are worth in tokens/s is the GPU bench's to measure, not this file's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, BloomConfig, LlamaConfig, Trainer, TrainingArguments

from llmops.config.schema import DataConfig, TrainConfig
from llmops.io.errors import UserError
from llmops.objectives import selected
from llmops.training import speed
from llmops.training.launch import LaunchPlan
from llmops.training.trainer import common_arguments, decide_packing

CUDA, CPU = LaunchPlan("none", 1, 1, "cuda"), LaunchPlan("none", 1, 1, "cpu")


def tiny_llama() -> torch.nn.Module:
    return AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                        num_attention_heads=4, intermediate_size=64))


def test_auto_is_fast_on_cuda_and_off_on_cpu(tmp_path: Path) -> None:
    on_cuda = common_arguments(TrainConfig(), tmp_path, packed=True, plan=CUDA, row_length=2048)
    on_cpu = common_arguments(TrainConfig(), tmp_path, packed=True, plan=CPU, row_length=2048)
    assert (on_cuda["optim"], on_cpu["optim"]) == ("adamw_torch_fused", "adamw_torch")
    assert on_cuda["torch_compile"] is on_cpu["torch_compile"] is False  # per-layer compile is applied to the model
    assert speed.resolve(TrainConfig(), "cuda", "ddp").compile == "layers"
    assert speed.resolve(TrainConfig(), "cuda", "deepspeed").compile == "none"
    assert speed.resolve(TrainConfig(), "cuda", "fsdp").compile == "none"
    assert speed.resolve(TrainConfig(), "cpu", "none").compile == "none"
    # Liger only where it is installed (it is not here)
    assert on_cuda["use_liger_kernel"] is speed.liger_installed() and on_cpu["use_liger_kernel"] is False
    # no per-micro-step count of tokens by the Trainer (a GPU sync each time): the collator counts them
    assert on_cuda["include_num_input_tokens_seen"] == "no"


def test_each_lever_is_a_switch(tmp_path: Path) -> None:
    config = TrainConfig.model_validate({"speed": {"compile": "model", "fused_adamw": "off",
                                                   "micro_batch_tokens": 16384}})
    arguments = common_arguments(config, tmp_path, packed=True, plan=CUDA, row_length=2048)
    assert arguments["torch_compile"] is True and arguments["optim"] == "adamw_torch"
    assert arguments["per_device_train_batch_size"] == 8  # 16,384 tokens in rows of 2,048
    assert common_arguments(config, tmp_path, packed=False, plan=CUDA, row_length=2048)[
        "per_device_train_batch_size"] == 32  # unpacked: train.batch_size
    assert speed.micro_batch_rows(TrainConfig.model_validate({"speed": {"micro_batch_tokens": 100}}), 2048, True) == 1
    if not speed.liger_installed():
        with pytest.raises(UserError, match="train.speed.liger_kernel=on needs liger-kernel"):
            speed.resolve(TrainConfig.model_validate({"speed": {"liger_kernel": "on"}}), "cuda", "none")


def test_the_optimizer_is_fused_when_asked(tmp_path: Path) -> None:
    config = TrainConfig.model_validate({"speed": {"fused_adamw": "on"}})
    arguments = TrainingArguments(**common_arguments(config, tmp_path, packed=False, plan=CPU))
    optimizer = Trainer(model=tiny_llama(), args=arguments).create_optimizer()
    assert type(optimizer).__name__ == "AdamW" and optimizer.defaults["fused"] is True


def test_each_decoder_layer_is_compiled_in_place() -> None:
    model = tiny_llama()
    assert speed.compile_layers(model) == 2
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
    assert model.lm_head._compiled_call_impl is None and model.model.embed_tokens._compiled_call_impl is None


@pytest.fixture
def tokenized(tmp_path: Path) -> Path:
    ids = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]
    Dataset.from_dict({"input_ids": ids, "labels": ids}).save_to_disk(str(tmp_path / "train"))
    return tmp_path


def test_packing_asked_for_is_packing_or_one_line(tokenized: Path) -> None:
    objective = selected(DataConfig(kind="text"))
    assert decide_packing(TrainConfig(), objective, tiny_llama(), tokenized, 0)
    # BLOOM's ALiBi attention reads no position ids: packed samples would see each other
    bloom = AutoModelForCausalLM.from_config(BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4))
    with pytest.raises(UserError, match="train.packing: BloomForCausalLM with attention eager does not keep packed "
                                        "samples apart") as stopped:
        decide_packing(TrainConfig(), objective, bloom, tokenized, 0)
    assert "train.packing_fallback: true" in str(stopped.value) and "\n" not in str(stopped.value)
    assert decide_packing(TrainConfig(packing_fallback=True), objective, bloom, tokenized, 0) is False
    assert decide_packing(TrainConfig(packing=False), objective, tiny_llama(), tokenized, 0) is False
