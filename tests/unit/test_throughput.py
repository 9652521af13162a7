"""MFU and its inputs, against figures worked out by hand: the makers' peaks, the per-sample attention length, the
model FLOPs per token and the real tokens counted on the host, without a GPU sync per step."""

from __future__ import annotations

import pytest
from transformers import GPT2Config, GPT2LMHeadModel, TrainerControl, TrainerState, TrainingArguments

from llmops.text.packing import BatchMeter, PackedRows
from llmops.training import throughput
from llmops.training.callbacks import ThroughputCallback
from llmops.training.tally import Tally


@pytest.mark.parametrize(("name", "peak"), [("NVIDIA H200", 989.4), ("NVIDIA H100 80GB HBM3", 989.4),
                                            ("NVIDIA H100 PCIe", 756.5), ("NVIDIA H200 NVL", 835.5),
                                            ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA L40S", 362.0),
                                            ("NVIDIA L4", 121.0), ("Tesla T4", None)])
def test_the_peak_is_the_makers_dense_bf16_figure(name: str, peak: float | None) -> None:
    assert throughput.peak_for(name) == peak


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
