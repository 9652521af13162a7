"""Bounded memory: ingest and validate stream, so their peak resident memory does not grow with the data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.reliability, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def bench(gigabytes: float) -> dict:
    """The benchmark with small validation chunks, so that a small file already spans many of them."""
    result = subprocess.run([sys.executable, str(REPO / "bench" / "ingest_validate_bench.py"), "--gigabytes",
                             str(gigabytes), "--chunk-rows", "2000", "--max-rss-mb", "1024"], cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout[result.stdout.index("{"):])


def test_peak_memory_stays_flat_as_the_data_grows() -> None:
    small, large = bench(0.004), bench(0.024)  # 3 and 15 chunks
    assert large["rows_read"] > 5 * small["rows_read"]
    assert large["rows_read"] == large["rows_kept"] + large["rows_quarantined"]
    assert large["peak_rss_mb"] < 1024
    # six times the data, the same memory (give or take the allocator)
    assert large["peak_rss_mb"] - small["peak_rss_mb"] < 32, (small, large)
    assert large["rows_per_s"] > 0 and large["mb_per_s"] > 0
