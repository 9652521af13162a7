"""MFU and its inputs, against figures worked out by hand: the makers' peaks, the per-sample attention length, the
model FLOPs per token and the real tokens counted on the host, without a GPU sync per step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from llmops.models import modeling
from llmops.text.packing import BatchMeter, PackedRows
from llmops.training import throughput
from llmops.training.callbacks import ThroughputCallback
from llmops.training.tally import Tally


@pytest.mark.parametrize(("name", "peak"), [("NVIDIA H200", 989.4), ("NVIDIA H100 80GB HBM3", 989.4),
                                            ("NVIDIA H100 PCIe", 756.5), ("NVIDIA H200 NVL", 835.5),
                                            ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA L40S", 362.0),
                                            ("NVIDIA L4", 121.0), ("Tesla T4", None),
                                            # whole names only: an L40 is no L4, a GH200 no H200
                                            ("NVIDIA L40", None), ("NVIDIA GH200 480GB", None)])
def test_the_peak_is_the_makers_dense_bf16_figure(name: str, peak: float | None) -> None:
    assert throughput.peak_for(name) == peak


def untied_llama() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False))


# the untied Llama's weights that multiply: attention 4·32·32, MLP 3·32·64, norms 3·32, the head 64·32; its input
# embedding (64·32) is a lookup
MATMUL_WEIGHTS = 4096 + 6144 + 96 + 2048
ATTENTION = 12 * 1 * 32 * 8.0  # 12·L·d·T at T = 8


def test_an_untied_input_embedding_is_a_lookup_not_a_matmul() -> None:
    model = untied_llama()
    assert sum(p.numel() for p in model.parameters()) == MATMUL_WEIGHTS + 2048
    assert throughput.flops_per_token(model, 8.0) == 6 * 12_384 + ATTENTION == 77_376.0


def packed_4bit(weight: torch.Tensor) -> torch.nn.Parameter:
    """A weight as bitsandbytes' Params4bit holds it: two 4-bit values a byte, its shape in its quant_state."""
    packed = torch.nn.Parameter(torch.zeros(weight.numel() // 2, 1, dtype=torch.uint8), requires_grad=False)
    packed.quant_state = SimpleNamespace(shape=weight.shape)
    return packed


def test_lora_and_qlora_count_a_frozen_weight_4n_and_mfu_does_not_read_high() -> None:
    lora = get_peft_model(untied_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    adapter = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert adapter == 2 * (4 * 32 + 32 * 4)  # A and B of q_proj and v_proj
    per_token = throughput.flops_per_token(lora, 8.0)
    assert per_token == 6 * 512 + 4 * 12_384 + ATTENTION == 55_680.0
    # QLoRA: the frozen linear weights packed 4-bit count at their real size, so the FLOPs are the same
    for module in lora.modules():
        if isinstance(module, torch.nn.Linear) and not module.weight.requires_grad:
            module.weight = packed_4bit(module.weight)
    assert throughput.flops_per_token(lora, 8.0) == per_token
    assert modeling.parameter_counts(lora) == {"parameters": 12_384 + 2048 + 512, "trainable_parameters": 512}
    # 10,000 tokens/s of this adapter against a 1 GFLOP/s peak; the old 6·N over every weight read 1.67 times higher
    rates = throughput.throughput(tokens=100_000, seconds=10.0, per_token_flops=per_token, world_size=1, peak=0.001)
    assert rates["mfu"] == 0.5568
    old = throughput.throughput(100_000, 10.0, 6 * (12_384 + 2048 + 512) + ATTENTION, 1, peak=0.001)
    assert old["mfu"] == 0.9274


def trained(tally: Tally, rows: list[dict]) -> None:
    """`rows` collated, drawn and trained on."""
    tally.draw(tally.meter(rows))
    tally.take_ids()


def test_the_attention_length_is_per_sample_when_samples_are_isolated() -> None:
    tally = Tally(BatchMeter(PackedRows(pad_token_id=0, width=8)))
    # two packed rows: samples of 3 and 1 tokens, and one of 4; an unpacked row of 6 is one sample
    trained(tally, [{"input_ids": [5, 6, 7, 8], "labels": [5, 6, 7, 8], "seq_lengths": [3, 1], "sample_ids": [0] * 4},
                    {"input_ids": [1, 2, 3, 4], "labels": [1, 2, 3, 4], "seq_lengths": [4], "sample_ids": [1] * 4}])
    assert tally.attention_length() == pytest.approx((9 + 1 + 16) / 8)  # Σ L² / Σ L = 3.25, not the row width 8
    trained(tally, [{"input_ids": [1, 2, 3, 4, 5, 6], "labels": [1, 2, 3, 4, 5, 6], "sample_ids": 2}])
    assert tally.attention_length() == pytest.approx((26 + 36) / 14)


def test_mfu_against_hand_computed_figures() -> None:
    model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100, n_positions=128))
    n = sum(p.numel() for name, p in model.named_parameters() if "wpe" not in name)
    assert n == 106_496  # 100·64 token embeddings, 2 layers of 49,984 (attention, MLP, norms), the final norm 128
    assert throughput.flops_per_token(model, 3.25) == 6 * 106_496 + 12 * 2 * 64 * 3.25 == 643_968.0
    # a 1B-class run: 50,000 tokens/s on each of 8 H200s at 7.5 GFLOP per token is 375 TFLOP/s per device
    rates = throughput.throughput(tokens=4_000_000, seconds=10.0, per_token_flops=7.5e9, world_size=8, peak=989.4)
    assert rates == {"tokens_per_s": 400_000.0, "tflops_per_device": 375.0, "mfu": 0.379, "peak_tflops": 989.4}
    assert throughput.throughput(1000, 0.0, 1e9, 1, peak=989.4)["mfu"] is None


def test_tokens_are_counted_from_the_collator_at_each_step(tmp_path) -> None:  # noqa: ANN001
    """One process: the state's count follows the batches trained on (not those collated ahead) step by step."""
    tally = Tally(BatchMeter(PackedRows(pad_token_id=0)))
    clock = ThroughputCallback(skip_steps=1, meter=tally)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    state, control = TrainerState(max_steps=3), TrainerControl()
    clock.on_train_begin(args, state, control)
    rows = [[{"input_ids": [1] * n, "labels": [1] * n, "sample_ids": n}] for n in (5, 7, 11)]
    tally.draw(tally.meter(rows[0]))
    for step, row in enumerate(rows[1:] + [None], start=1):
        if row is not None:
            tally.draw(tally.meter(row))  # drawn before this one is trained on
        tally.take_ids()
        state.global_step = step
        clock.on_step_end(args, state, control)
        assert state.num_input_tokens_seen == sum(len(r[0]["input_ids"]) for r in rows[:step])
    clock.on_train_end(args, state, control)
    assert clock.rate()[0] == 7 + 11  # the steady part: after the first (skipped) step
