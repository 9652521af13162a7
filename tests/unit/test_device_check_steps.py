"""The device check's steps: one JSON line whatever happens (figures so far on a timeout), nothing a step started
survives it, and the limits fit the budget."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNNER = REPO / "bench" / "run_step.py"


def run_step(tmp_path: Path, script: str, limit: float) -> tuple[dict, int, float]:
    (tmp_path / "step.py").write_text(textwrap.dedent(script))
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(RUNNER), "demo", str(limit), "--logs", str(tmp_path), "--",
                             sys.executable, str(tmp_path / "step.py"), str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout + result.stderr
    return json.loads(lines[0]), result.returncode, time.monotonic() - started


def alive(pid: int) -> bool:
    """Whether the process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


# a step that trains "forever": progress lines, then a detached worker (its own session, as the launcher starts
# them) and a plain child, both of which would outlive a kill of the step's process group alone
FOREVER = """
    import json, subprocess, sys, time
    from pathlib import Path
    folder = Path(sys.argv[1])
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    (folder / "pids").write_text(f"{worker.pid} {child.pid}")
    for step in (10, 20):
        print(json.dumps({"progress": True, "steps": step, "tokens_per_s": 1000.0 * step}), flush=True)
    time.sleep(300)
"""


def test_a_step_over_its_limit_prints_its_progress_with_timed_out_and_leaves_no_process(tmp_path: Path) -> None:
    line, code, seconds = run_step(tmp_path, FOREVER, limit=2)
    assert code == 124 and seconds < 10
    assert line["timed_out"] is True and line["step"] == "demo" and line["limit_s"] == 2
    assert (line["steps"], line["tokens_per_s"]) == (20, 20000.0) and "progress" not in line
    pids = [int(pid) for pid in (tmp_path / "pids").read_text().split()]
    assert pids and not any(alive(pid) for pid in pids)


def test_a_step_that_ends_leaves_no_detached_worker_behind(tmp_path: Path) -> None:
    script = """
        import json, subprocess, sys
        from pathlib import Path
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
        Path(sys.argv[1], "pids").write_text(str(worker.pid))
        print(json.dumps({"shape": "x", "tokens_per_s": 5.0}))
    """
    line, code, _ = run_step(tmp_path, script, limit=30)
    assert code == 0 and line["tokens_per_s"] == 5.0 and line["killed_after_exit"] == 1
    assert not alive(int((tmp_path / "pids").read_text()))


def test_a_step_that_dies_before_any_figure_still_has_its_line(tmp_path: Path) -> None:
    line, code, _ = run_step(tmp_path, "import pydantic_missing_here\n", limit=30)
    assert code == 1 and line["exit"] == 1
    assert "ModuleNotFoundError: No module named 'pydantic_missing_here'" in line["error"]


def test_a_step_that_cannot_run_here_is_not_a_failure(tmp_path: Path) -> None:
    script = 'import json, sys; print(json.dumps({"status": "not run", "detail": "no bitsandbytes"})); sys.exit(3)\n'
    line, code, _ = run_step(tmp_path, script, limit=30)
    assert code == 3 and line["detail"] == "no bitsandbytes"


def test_the_limits_add_up_to_less_than_the_budget_which_fits_a_device_call() -> None:
    result = subprocess.run(["bash", "bench/device_check.sh", "--plan"], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    budget, total = map(int, re.search(r"budget (\d+)s; the steps' limits add up to (\d+)s", result.stdout).groups())
    limits = [int(limit) for limit in re.findall(r"timeout (\d+)s", result.stdout)]
    # the wheels' install and the processes' start need the rest of the call's 600 s
    assert len(limits) == 6 and sum(limits) == total < budget and budget + 100 <= 600
    # the dry mode's own limits (CPU, no device call) fit its own budget too
    modes = re.findall(r"BUDGET=\$\{LLMOPS_CHECK_BUDGET:-(\d+)\}; SHAPE_LIMITS=\(([\d ]+)\); SMOKE_LIMITS=\(([\d ]+)\)",
                       (REPO / "bench/device_check.sh").read_text())
    assert len(modes) == 2 and int(modes[1][0]) == budget
    assert all(sum(int(n) for n in f"{shapes} {smokes}".split()) < int(limit) for limit, shapes, smokes in modes)


def test_a_budget_smaller_than_the_limits_is_refused() -> None:
    result = subprocess.run(["bash", "bench/device_check.sh", "--plan"], cwd=REPO, capture_output=True, text=True,
                            timeout=60, env={**os.environ, "LLMOPS_CHECK_BUDGET": "300"})
    assert result.returncode == 2 and "add up to 455s, not under the 300s budget" in result.stderr


def test_a_stopped_check_ends_its_step_with_its_line_and_no_survivor(tmp_path: Path) -> None:
    # the device call running out of time signals the check: the step's own session never sees it, the runner does
    (tmp_path / "step.py").write_text(textwrap.dedent(FOREVER))
    runner = subprocess.Popen([sys.executable, str(RUNNER), "demo", "60", "--logs", str(tmp_path), "--",
                               sys.executable, str(tmp_path / "step.py"), str(tmp_path)], stdout=subprocess.PIPE,
                              text=True)
    deadline, out = time.monotonic() + 30, tmp_path / "demo.out"
    while not (out.exists() and '"steps": 20' in out.read_text()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    runner.send_signal(signal.SIGTERM)
    line = json.loads(runner.communicate(timeout=30)[0])
    assert runner.returncode == 124 and line["timed_out"] is True and line["stopped_by"] == "SIGTERM"
    assert line["steps"] == 20
    pids = [int(pid) for pid in (tmp_path / "pids").read_text().split()]
    assert not any(alive(pid) for pid in pids)
