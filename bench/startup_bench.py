"""Start-up cost of the command, as a user meets it: a no-op re-run of the pipeline against `dvc status`.

In a fresh clone of this project: `llmops data init`, one full `llmops run CONFIG`; then, each timed
`--repeat` times (the median counts), the no-op re-run (every stage reused), `dvc status`,
`llmops --help` and `llmops plan CONFIG`. Prints one JSON object: the seconds, the ratios and
whether each goal holds (no-op <= 5x dvc status, --help <= 1 s, plan <= 3 s).

    python bench/startup_bench.py [--config configs/default.yaml] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
GOALS = {"noop_over_dvc_status": 5.0, "help_seconds": 1.0, "plan_seconds": 3.0}


def timed(command: list[str], cwd: Path, repeat: int) -> float:
    """The median wall seconds of `command` (which must succeed)."""
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(command, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        seconds.append(time.perf_counter() - start)
    return round(statistics.median(seconds), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    os.environ.pop("LLMOPS_HOME", None)  # the clone's own workspace
    with tempfile.TemporaryDirectory() as scratch:
        clone = Path(scratch) / "project"
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
        llmops, dvc = str(BIN / "llmops"), str(BIN / "dvc")
        subprocess.run([llmops, "data", "init"], cwd=clone, check=True, stdout=subprocess.DEVNULL)
        start = time.perf_counter()
        subprocess.run([llmops, "run", args.config], cwd=clone, check=True, stdout=subprocess.DEVNULL)
        first = round(time.perf_counter() - start, 1)
        figures = {
            "noop_run_seconds": timed([llmops, "run", args.config], clone, args.repeat),
            "dvc_status_seconds": timed([dvc, "status"], clone, args.repeat),
            "help_seconds": timed([llmops, "--help"], clone, args.repeat),
            "plan_seconds": timed([llmops, "plan", args.config], clone, args.repeat),
        }
    figures["noop_over_dvc_status"] = round(figures["noop_run_seconds"] / figures["dvc_status_seconds"], 2)
    met = {name: figures[name] <= goal for name, goal in GOALS.items()}
    print(json.dumps({"bench": "startup", "config": args.config, "first_run_seconds": first, **figures,
                      "goals": GOALS, "met": met, "cpus": os.cpu_count()}))


if __name__ == "__main__":
    main()
