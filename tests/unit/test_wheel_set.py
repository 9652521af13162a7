"""The wheels the device check needs beyond the bare GPU machine: every requirement pinned, and the set checked,
with the tree, against the 64 MiB a device call carries."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def wheel_check(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/wheel_set.py", "check", str(folder)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_the_wheel_set_fails_clearly_when_it_and_the_tree_pass_64_mib(tmp_path: Path) -> None:
    with (tmp_path / "big-1.0-py3-none-any.whl").open("wb") as handle:
        handle.truncate(63 * 1024 * 1024)  # sparse: the size counts, not the blocks
    over = wheel_check(tmp_path)
    assert over.returncode == 1 and over.stdout.startswith("too big to travel: 1 wheels 63.0 MiB + tree ")
    with (tmp_path / "big-1.0-py3-none-any.whl").open("wb") as handle:
        handle.truncate(40 * 1024 * 1024)
    fits = wheel_check(tmp_path)
    assert fits.returncode == 0 and fits.stdout.startswith("1 wheels 40.0 MiB + tree ")
    tree = float(re.search(r"tree ([\d.]+) MiB", fits.stdout)[1])
    assert 0.5 < tree < 20  # the tracked and untracked files of this checkout, not the ignored ones


def test_the_wheel_list_pins_every_requirement() -> None:
    sys.path.insert(0, str(REPO / "bench"))
    import wheel_set

    pinned = wheel_set.requirements()
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+==[\w.]+", line) for line in pinned), pinned
    names = {line.split("==")[0].lower() for line in pinned}
    assert {"datasets", "trl", "pyarrow", "huggingface-hub", "dill", "multiprocess", "xxhash", "pydantic"} <= names
    assert int(next(line for line in pinned if line.startswith("pyarrow==")).split("==")[1].split(".")[0]) >= 24
    assert "bitsandbytes" not in names  # about 60 MB: QLoRA is NOT RUN without it
