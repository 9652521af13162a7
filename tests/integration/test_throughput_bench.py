"""The GPU throughput bench, run dry on CPU (moved from tests/unit/test_launch.py: it trains two models)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_gpu_throughput_bench_runs_dry_on_cpu() -> None:
    result = subprocess.run([sys.executable, "bench/gpu_train_bench.py", "--dry", "--steps", "4"], cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout[result.stdout.index("{"):])
    assert [s["shape"] for s in report["shapes"]] == ["llama1b", "gpt2"]
    for shape in report["shapes"]:
        assert shape["steps"] == 4 and shape["tokens_per_s"] > 0 and shape["packed"]
        # 6·N + 12·L·d·T, N without learned position embeddings (llama has none; gpt2's wpe is left out)
        layers, hidden, length = 2, 64, 64  # the bench's dry shapes
        counted = (shape["flops_per_token"] - 12 * layers * hidden * length) / 6
        if shape["shape"] == "llama1b":
            assert counted == shape["parameters"]
        else:
            assert 0 < counted < shape["parameters"]
