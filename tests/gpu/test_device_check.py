"""On a CUDA machine: the device check runs every bench shape and smoke training, within 8 minutes, and every step
passes. Skipped without CUDA."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def test_the_device_check_passes_every_step_within_eight_minutes() -> None:
    started = time.monotonic()
    result = subprocess.run(["bash", "bench/device_check.sh"], cwd=REPO, capture_output=True, text=True, timeout=600,
                            env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHON": sys.executable})
    assert time.monotonic() - started < 8 * 60
    lines = result.stdout.strip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("step "))
    rows = {line.split()[0]: line for line in lines[header + 1:]}
    assert {"bench-llama1b", "bench-gpt2", "smoke-zero2", "smoke-zero3", "smoke-fsdp2", "smoke-qlora"} <= set(rows)
    assert result.returncode == 0, "\n".join(lines[header:])
