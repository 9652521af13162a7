"""Saving a LoRA adapter trained under FSDP2 gathers the adapter's tensors only, never the frozen base's: a real
fully_shard model on a one-process gloo group on the CPU, each gathered tensor counted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

from llmops.training import checkpoints


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))


@pytest.fixture
def process_group(tmp_path: Path):  # noqa: ANN201 - a generator of nothing
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fsdp2_adapter_save_gathers_the_adapter_only(process_group: None, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                    init_lora_weights=False))
    adapter = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    gathered = []
    full_tensor = DTensor.full_tensor

    def counted(self: DTensor, **kwargs: object) -> torch.Tensor:
        gathered.append(self.shape)
        return full_tensor(self, **kwargs)

    monkeypatch.setattr(DTensor, "full_tensor", counted)
    checkpoints.save_gathered(model, model, tmp_path / "adapter", main=True)
    # 2 layers x (q_proj, v_proj) x (lora_A, lora_B); the base holds 29 tensors
    assert len(model.state_dict()) == 29 and len(gathered) == 8
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert len(saved) == 8 and all(".lora_" in name for name in saved)
    loaded = PeftModel.from_pretrained(tiny_llama(), str(tmp_path / "adapter"))
    for name, parameter in loaded.named_parameters():
        if ".lora_" in name:
            torch.testing.assert_close(parameter, adapter[name], rtol=0, atol=0)


def test_a_model_without_an_adapter_saves_every_entry() -> None:
    model = tiny_llama()
    assert checkpoints.adapter_names(model, model.state_dict()) is None
