"""Load dtypes and the compute precision, chosen on purpose: a checkpoint stored in bf16 or fp16 trains with fp32
master weights (its small updates land, its fp16 gradients unscale), and bf16 only on cards that run it natively.
The cards are their compute capabilities (no GPU here); the models, optimizer and grad scaler are torch's own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmops.config.schema import DataConfig, ModelConfig, TrainConfig
from llmops.models import modeling, precision
from llmops.objectives import selected
from llmops.training import trainer

TEXT = selected(DataConfig(kind="text"))
T4, V100, A100, H100 = (7, 5), (7, 0), (8, 0), (9, 0)


def stored_checkpoint(folder: Path, dtype: torch.dtype) -> Path:
    """A tiny pretrained Llama saved in `dtype`, as hub checkpoints are (bf16 or fp16 on disk)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(config).to(dtype).save_pretrained(str(folder))
    return folder


def small_step(model: torch.nn.Module) -> float:
    """One AdamW step of lr 1e-6 (far below a bf16 weight's last bit): the share of a weight's entries it moved."""
    weight = model.model.layers[0].mlp.up_proj.weight
    before = weight.detach().clone()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6, weight_decay=0.0)
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return (weight.detach() != before).float().mean().item()


def test_full_fine_tuning_of_a_bf16_checkpoint_keeps_fp32_weights_and_its_small_updates_land(tmp_path: Path) -> None:
    folder = stored_checkpoint(tmp_path / "base", torch.bfloat16)
    config = ModelConfig(name_or_path=str(folder))
    dtype = precision.load_dtype("bf16", adapter="none", sharded=False)
    model = TEXT.build_model(config, None, 0, [], dtype=dtype)
    assert dtype == "float32" and precision.parameter_dtypes(model) == {"trainable_dtype": "float32",
                                                                        "frozen_dtype": None}
    assert small_step(model) > 0.99
    # as transformers loads it unless told (the stored dtype): pure-bf16 AdamW rounds nearly every update away
    as_stored = TEXT.build_model(config, None, 0, [])
    assert next(as_stored.parameters()).dtype == torch.bfloat16
    assert small_step(as_stored) < 0.1


def scaled_backward(model: torch.nn.Module) -> torch.optim.Optimizer:
    scaler = torch.amp.GradScaler("cpu")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    ids = torch.tensor([[1, 5, 9, 13]])
    scaler.scale(model(input_ids=ids, labels=ids).loss.float()).backward()
    scaler.unscale_(optimizer)
    return optimizer


def test_an_fp16_checkpoint_trained_in_fp16_unscales_its_gradients(tmp_path: Path) -> None:
    folder = stored_checkpoint(tmp_path / "base", torch.float16)
    config = ModelConfig(name_or_path=str(folder))
    model = TEXT.build_model(config, None, 0, [], dtype=precision.load_dtype("fp16", "none", sharded=False))
    scaled_backward(model)  # the fp32 master weights' gradients unscale
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaled_backward(TEXT.build_model(config, None, 0, []))  # the checkpoint's own dtype: what failed


def test_a_lora_base_stays_half_and_what_trains_beside_it_is_fp32(tmp_path: Path) -> None:
    folder = stored_checkpoint(tmp_path / "base", torch.float16)
    config = ModelConfig(name_or_path=str(folder), adapter="lora", lora={"target_modules": ["q_proj", "v_proj"]})
    dtype = precision.load_dtype("fp16", "lora", sharded=False)
    model = TEXT.with_adapter(TEXT.build_model(config, None, 0, [], dtype=dtype), config, False)
    assert dtype == "float16"
    assert precision.parameter_dtypes(model) == {"trainable_dtype": "float32", "frozen_dtype": "float16"}
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
    scaled_backward(model)


@pytest.mark.parametrize(("precision_set", "adapter", "sharded", "expected"), [
    ("bf16", "none", False, "float32"), ("fp16", "none", False, "float32"), ("fp32", "lora", False, "float32"),
    ("bf16", "lora", False, "bfloat16"), ("fp16", "lora", False, "float16"),
    # sharded (FSDP, ZeRO-3): one dtype per shard group, the engine's mixed precision computes in half
    ("bf16", "lora", True, "float32")])
def test_the_load_dtype_follows_what_trains(precision_set: str, adapter: str, sharded: bool, expected: str) -> None:
    assert precision.load_dtype(precision_set, adapter, sharded) == expected


@pytest.mark.parametrize(("capability", "expected"), [(None, "fp32"), (V100, "fp16"), (T4, "fp16"),
                                                      (A100, "bf16"), (H100, "bf16")])
def test_auto_precision_is_bf16_only_where_the_card_runs_it_natively(capability: tuple[int, int] | None,
                                                                     expected: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # what torch says of T4 and V100 (bf16 "supported", by emulation) must not matter
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    monkeypatch.setattr(modeling, "cuda_capability", lambda: capability)
    flags = trainer.precision_flags(TrainConfig())
    assert trainer.training_precision(TrainConfig()) == expected
    assert flags == {"bf16": expected == "bf16", "fp16": expected == "fp16"}
    assert precision.half_dtype_name(capability) == ("bfloat16" if expected == "bf16" else "float16")


def test_bf16_set_by_hand_on_an_older_card_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(modeling, "cuda_capability", lambda: T4)
    with pytest.raises(precision.PrecisionError, match=r"compute capability 7\.5.*train\.precision to auto or fp16"):
        trainer.precision_flags(TrainConfig(precision="bf16"))
    assert trainer.training_precision(TrainConfig(precision="fp16")) == "fp16"
    monkeypatch.setattr(modeling, "cuda_capability", lambda: None)
    assert trainer.training_precision(TrainConfig(precision="bf16")) == "bf16"  # CPU autocast runs bf16


@pytest.mark.parametrize(("major", "expected"), [(7, "sdpa"), (8, "flex_attention"), (9, "flex_attention")])
def test_flex_attention_only_on_cards_that_run_it(major: int, expected: str) -> None:
    from transformers import LlamaForCausalLM

    found = modeling.Capabilities(cuda=True, major=major)
    assert modeling.attention_for(ModelConfig(architecture="llama"), LlamaForCausalLM, found) == expected
