"""What the GPU bench measures: the ~1B shape trains SFT (loss on the completions only), the window holds only full
batches of one shape and lasts the steady seconds asked for, and packed rows always have the same width."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from llmops.objectives import selected
from llmops.text import packing
from llmops.text.encoding import IGNORE_INDEX

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import gpu_train_bench  # noqa: E402 - bench/ is a folder of scripts, not a package


def test_the_1b_shape_trains_the_sft_objective_and_gpt2_a_causal_lm() -> None:
    llama = gpu_train_bench.shape_config("llama1b", dry=False, steps=160)
    gpt2 = gpu_train_bench.shape_config("gpt2", dry=False, steps=700)
    assert selected(llama.data).name == "sft" and selected(gpt2.data).name == "causal_lm"
    assert (llama.model.hidden_size, llama.model.num_layers, llama.tokenize.max_length) == (2048, 16, 2048)
    assert llama.train.packing and gpt2.train.packing


def test_the_synthetic_sft_rows_learn_only_their_completions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from datasets import load_from_disk

    monkeypatch.setenv("LLMOPS_HOME", str(tmp_path))
    record = gpu_train_bench.synthetic_tokenized("t", 64, [10, 20, 30], 32, prompt_share=0.4)
    rows = load_from_disk(str(record.dir / "train"))
    for ids, labels in zip(rows["input_ids"], rows["labels"], strict=True):
        prompt = int(len(ids) * 0.4)
        assert labels[:prompt] == [IGNORE_INDEX] * prompt and labels[prompt:] == ids[prompt:]
    assert record.figures.train.target_tokens == 6 + 12 + 18


def test_the_synthetic_samples_stop_once_they_hold_the_tokens_asked_for() -> None:
    assert gpu_train_bench.enough([3, 4, 5, 6], 7) == [3, 4]
    assert gpu_train_bench.enough([3, 4], 100) == [3, 4]


class Rows:
    def __init__(self, count: int) -> None:
        self.dataset = list(range(count))


def window_args(batch: int = 4) -> SimpleNamespace:
    return SimpleNamespace(per_device_train_batch_size=batch, gradient_accumulation_steps=1, world_size=1)


def steps(window: object, last: int, max_steps: int, pause: float = 0.0) -> tuple[int, str]:
    """Drive the callback like the Trainer: the step at which it stops the training, and why."""
    args, state = window_args(), SimpleNamespace(global_step=0, max_steps=max_steps, num_input_tokens_seen=0)
    window.on_train_begin(args, state, None, train_dataloader=Rows(last))
    for step in range(1, max_steps + 1):
        control = SimpleNamespace(should_training_stop=False)
        state.global_step, state.num_input_tokens_seen = step, step * 100
        time.sleep(pause)
        window.on_step_end(args, state, control)
        if control.should_training_stop:
            return step, window.stopped_by
    return max_steps, window.stopped_by


def test_the_window_stops_before_the_epochs_partial_last_batch() -> None:
    # 22 rows in batches of 4: 5 full batches, then one of 2 rows (another shape, another compilation)
    window = gpu_train_bench.measured_window("x", seconds=0.0, skip=1)
    assert steps(window, last=22, max_steps=50) == (5, "epoch_end")
    # with rows for more than max_steps, max_steps ends it
    assert steps(gpu_train_bench.measured_window("x", 0.0, 1), last=400, max_steps=50) == (50, "max_steps")


def test_the_window_ends_after_its_steady_seconds_counted_from_the_warm_up(capsys: pytest.CaptureFixture) -> None:
    window = gpu_train_bench.measured_window("x", seconds=0.2, skip=2)
    stopped, why = steps(window, last=4000, max_steps=1000, pause=0.02)
    assert why == "seconds" and 2 + 0.2 / 0.02 <= stopped < 2 + 3 * 0.2 / 0.02
    window.on_train_end(window_args(), SimpleNamespace(global_step=stopped), None)
    assert window.seconds >= 0.2 and window.steps == stopped - 2
    state = SimpleNamespace(global_step=stopped, num_input_tokens_seen=stopped * 100)
    window.on_log(window_args(), state, None)
    progress = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert progress["progress"] is True and progress["steps"] == stopped
    assert 0 < progress["tokens_per_s"] <= 100 / 0.02


def test_packed_rows_have_one_width_whatever_their_lengths() -> None:
    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa"))
    collate = packing.packed_collator(model, pad_token_id=0, max_length=16)
    short = collate([{"input_ids": [1, 2, 3], "seq_lengths": [3]}])
    longer = collate([{"input_ids": list(range(1, 12)), "seq_lengths": [5, 6]}, {"input_ids": [4, 5]}])
    assert short["input_ids"].shape == (1, 16) and longer["input_ids"].shape == (2, 16)
    assert longer["labels"][0, 11:].tolist() == [IGNORE_INDEX] * 5 and longer["position_ids"][0, :11].tolist() == [
        0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5]
