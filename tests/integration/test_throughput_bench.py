"""The GPU throughput bench, run dry on CPU (moved from tests/unit/test_launch.py: it trains two models)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_gpu_throughput_bench_runs_dry_on_cpu_and_a_failing_shape_loses_only_its_own_line() -> None:
    """GPT-2 forced onto flex_attention (which it does not support) fails first; llama1b still runs, and each shape's
    line is printed as it finishes."""
    result = subprocess.run([sys.executable, "bench/gpu_train_bench.py", "--dry", "--steps", "4", "--shape", "gpt2",
                             "--shape", "llama1b", "--set", "gpt2:model.attention=flex_attention"], cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stderr[-3000:]  # a shape failed
    # the progress lines printed while a shape trains aside, one line per shape
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    lines = [line for line in lines if not line.get("progress")]
    assert [line["shape"] for line in lines] == ["gpt2", "llama1b"]
    failed, shape = lines
    assert "GPT2LMHeadModel does not support it" in failed["error"] and "steps" not in failed
    assert shape["steps"] == 4 and shape["tokens_per_s"] > 0 and shape["packed"] and shape["attention"] == "sdpa"
    # 6·N + 12·L·d·T, T the attention length per sample (Σ L² / Σ L), never more than the row width
    layers, hidden, length = 2, 64, 64  # the bench's dry shapes
    assert 0 < shape["attention_length"] <= length
    counted = (shape["flops_per_token"] - 12 * layers * hidden * shape["attention_length"]) / 6
    # llama has no learned position embeddings; the figures round the attention length to 2 decimals
    assert counted == pytest.approx(shape["parameters"], abs=12 * layers * hidden * 0.005 / 6)


@pytest.mark.slow
def test_the_measured_window_ends_at_the_last_full_batch_of_the_real_trainers_first_epoch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With samples for fewer packed rows than max_steps needs, training stops before the partial batch: every step
    measured had a full batch of max_length-wide rows."""
    monkeypatch.setenv("LLMOPS_HOME", str(tmp_path))
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_train_bench

    from llmops.io.files import load_dataset_dir
    from llmops.text import packing

    real = gpu_train_bench.lengths
    monkeypatch.setattr(gpu_train_bench, "lengths", lambda count, *args: real(count // 4, *args))
    shape = gpu_train_bench.run_shape("gpt2", dry=True, steps=12)
    samples = load_dataset_dir(next((tmp_path / "artifacts" / "tokenize").glob("bench-gpt2-*")) / "train")
    rows = len(packing.pack(packing.with_sample_ids(samples, per_token=True), 64))
    assert shape["stopped_by"] == "epoch_end" and shape["steps"] == rows // 2 < 12  # the dry shapes' batch: 2 rows
