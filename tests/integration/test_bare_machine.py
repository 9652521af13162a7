"""What a bare CUDA machine has is enough for the train stage and the bench: with Prefect, MLflow, DVC,
great-expectations and rensa made absent, they import and train; and the device check is honest without a GPU."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
ABSENT = ("prefect", "mlflow", "dvc", "great_expectations", "rensa")

# None in sys.modules is how Python marks a module absent: its import raises ModuleNotFoundError and
# importlib.util.find_spec answers None, as libraries probing for optional packages (accelerate, transformers)
# see on a machine without them
WITHOUT_ORCHESTRATION = textwrap.dedent(f"""
    import runpy, sys
    for name in {ABSENT!r}:
        sys.modules[name] = None
    sys.path.insert(0, "bench")
    import llmops.training.train, llmops.training.worker, smoke_train
    sys.argv = ["bench/gpu_train_bench.py", "--dry", "--steps", "2", "--shape", "gpt2"]
    try:
        runpy.run_path("bench/gpu_train_bench.py", run_name="__main__")
    except SystemExit as done:
        assert not done.code, done.code
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in {ABSENT!r} and sys.modules[m] is not None)
    print("leaked:", leaked)
""")


def test_the_train_stage_and_the_bench_run_without_orchestration_packages(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-c", WITHOUT_ORCHESTRATION], cwd=REPO, capture_output=True, text=True,
                            timeout=600, env={"PATH": "/usr/bin:/bin", "LLMOPS_HOME": str(tmp_path),
                                              "DS_ACCELERATOR": "cpu", "HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-4000:]
    assert '"gpt2"' in result.stdout and '"tokens_per_s"' in result.stdout and '"packed": true' in result.stdout
    assert result.stdout.rstrip().endswith("leaked: []")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what the device check says without a GPU")
def test_the_device_check_runs_nothing_without_a_gpu_and_says_so_last(tmp_path: Path) -> None:
    result = subprocess.run(["bash", "bench/device_check.sh"], cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHON": sys.executable,
                                 "LLMOPS_WHEELS": str(tmp_path / "none"), "HOME": str(tmp_path)})
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("step "))
    rows = {line.split()[0]: line for line in lines[header + 1:]}
    assert set(rows) == {"wheels", "bench-llama1b", "bench-gpt2", "smoke-zero2", "smoke-zero3", "smoke-fsdp2",
                         "smoke-qlora"}
    assert "skipped" in rows.pop("wheels")
    assert all("NOT RUN" in row and "no CUDA device" in row for row in rows.values())
