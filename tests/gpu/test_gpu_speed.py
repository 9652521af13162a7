"""On a CUDA machine: the attention each architecture gets on this card (GPT-2 never flex_attention), the packing check
on this process's own device, and per-layer compilation training. Skipped without CUDA."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from llmops.config.schema import DataConfig, ModelConfig
from llmops.objectives import selected
from llmops.text import packing

# torch, transformers and the training modules are imported by the tests that run, not when the suite is collected
if TYPE_CHECKING:
    import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
SAMPLES = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]


def tiny_llama() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    return AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2,
                                                        num_attention_heads=4, intermediate_size=128))


def test_gpt2_gets_a_kernel_it_supports_and_keeps_packed_samples_apart() -> None:
    from transformers import AutoModelForCausalLM, GPT2Config

    from llmops.training.trainer import checking_device

    objective = selected(DataConfig(kind="text"))
    attention = objective.attention(ModelConfig(architecture="gpt2"))
    assert attention != "flex_attention"
    model = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=64, n_embd=64, n_layer=2, n_head=4),
                                             attn_implementation=attention)
    assert packing.packing_is_exact(model, SAMPLES, pad_token_id=0, device=checking_device())


def test_the_packing_check_runs_on_this_processs_device_and_leaves_the_model_where_it_was(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from llmops.training.trainer import checking_device

    monkeypatch.setenv("LOCAL_RANK", str(torch.cuda.device_count() - 1))
    assert checking_device() == f"cuda:{torch.cuda.device_count() - 1}"
    model = tiny_llama()
    assert packing.packing_is_exact(model, SAMPLES, pad_token_id=0, device=checking_device())
    assert next(model.parameters()).device.type == "cpu"


def test_compiled_layers_train() -> None:
    import torch

    from llmops.training import speed

    model = tiny_llama().cuda()
    assert speed.compile_layers(model) == 2
    ids = torch.randint(0, 64, (2, 32), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and model.model.layers[0].mlp.up_proj.weight.grad is not None
