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
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [line["shape"] for line in lines] == ["gpt2", "llama1b"]
    failed, shape = lines
    assert "GPT2LMHeadModel does not support it" in failed["error"] and "steps" not in failed
    assert shape["steps"] == 4 and shape["tokens_per_s"] > 0 and shape["packed"] and shape["attention"] == "sdpa"
    # 6·N + 12·L·d·T, T the attention length per sample (Σ L² / Σ L), never more than the row width
    layers, hidden, length = 2, 64, 64  # the bench's dry shapes
    assert 0 < shape["attention_length"] <= length
    counted = (shape["flops_per_token"] - 12 * layers * hidden * shape["attention_length"]) / 6
    assert counted == pytest.approx(shape["parameters"])  # llama has no learned position embeddings
