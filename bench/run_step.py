"""One step of the device check under its time limit, and its one JSON line whatever happens.

    python bench/run_step.py NAME LIMIT_S [--logs FOLDER] -- COMMAND...

The command runs in a session of its own. Its JSON lines on stdout are its figures: the last line without
"progress" is its result, lines with "progress" say how far it got. At the limit, everything the step started is
killed with SIGKILL, never SIGTERM: a training that receives SIGTERM stops with a checkpoint (several GB at the ~1B
shape), which is not what an overrun step should spend its last seconds on. Launched training workers run in
sessions of their own, so this process makes itself their subreaper: whatever the step started, however detached,
comes back to it and is killed too, at the limit and after a normal end alike; none survives the step.

Prints one JSON line: the step's result, or its last progress with "timed_out": true, or its error (the last line of
its stderr); stdout and stderr are kept in the folder of --logs. SIGTERM, SIGINT or SIGHUP to this process (a device
call that runs out of time) end the step the same way as its limit, the signal named in "stopped_by". Exit status: 0
when the step exited 0 with a result, 3 when its result says it could not run here ("status": "not run"), 124 when
it ran out of time or was stopped, 1 otherwise. Stdlib only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PR_SET_CHILD_SUBREAPER = 36
NOT_RUN = 3  # the step could not run on this machine and said why (status "not run"): not a failure


def become_subreaper() -> None:
    """Orphans of the step (a launcher's workers whose parent died) are reparented here rather than to init."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def descendants(root: int) -> list[int]:
    """Every live process below `root`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def kill_everything_below(root: int, rounds: int = 50) -> int:
    """SIGKILL every process below `root` and reap them; returns how many there were."""
    killed: set[int] = set()
    for _ in range(rounds):
        alive = descendants(root)
        if not alive:
            break
        for pid in alive:
            for kill in (os.killpg, os.kill):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    kill(pid, signal.SIGKILL)
            killed.add(pid)
        reap()
        time.sleep(0.05)
    return len(killed)


def reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def json_lines(text: str) -> list[dict[str, Any]]:
    found = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                found.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return found


def summary_line(name: str, stdout: str, stderr: str, code: int | None, limit: float) -> tuple[dict[str, Any], int]:
    """The step's one line and the exit status: its result, its progress when it ran out of time, or its error."""
    lines = json_lines(stdout)
    results = [line for line in lines if not line.get("progress")]
    progress = [line for line in lines if line.get("progress")]
    if code is None:
        reached = {key: value for key, value in (progress[-1] if progress else {}).items() if key != "progress"}
        return {"step": name, **reached, "timed_out": True, "limit_s": limit}, 124
    if code == 0 and results:
        return {"step": name, **results[-1]}, 0
    if results and results[-1].get("status") == "not run":
        return {"step": name, **results[-1]}, NOT_RUN
    if results:
        return {"step": name, **results[-1], "exit": code}, 1
    last = next((line for line in reversed(stderr.splitlines()) if line.strip()), "no output")
    return {"step": name, "error": last.strip()[:500], "exit": code}, 1


class Stopped(Exception):
    """This process was asked to stop (the device call ran out of time): the step ends as if at its limit."""


@contextlib.contextmanager
def stopping_on_signals(received: list[str]) -> Iterator[None]:
    """SIGTERM, SIGINT and SIGHUP end the step here, with its line, its process tree killed: the step's processes
    are in a session of their own, so a signal to the check's process group never reaches them."""

    def stop(signum: int, frame: Any) -> None:
        if received:  # already ending: the kill and the line go on
            return
        received.append(signal.Signals(signum).name)
        raise Stopped

    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {sig: signal.signal(sig, stop) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run(name: str, limit: float, command: list[str], logs: Path) -> tuple[dict[str, Any], int]:
    become_subreaper()
    out, err = logs / f"{name}.out", logs / f"{name}.err"
    started = time.monotonic()
    stopped_by: list[str] = []
    with out.open("w") as stdout, err.open("w") as stderr, stopping_on_signals(stopped_by):
        process = subprocess.Popen(command, stdout=stdout, stderr=stderr, start_new_session=True)
        try:
            code: int | None = process.wait(timeout=limit)
        except (subprocess.TimeoutExpired, Stopped):
            code = None
        survivors = kill_everything_below(os.getpid())
        process.wait()
    line, status = summary_line(name, out.read_text(errors="replace"), err.read_text(errors="replace"), code, limit)
    line["seconds"] = round(time.monotonic() - started, 1)
    if stopped_by:
        line["stopped_by"] = stopped_by[0]
    if survivors and code is not None:
        line["killed_after_exit"] = survivors
    return line, status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name")
    parser.add_argument("limit", type=float, help="seconds")
    parser.add_argument("--logs", type=Path, default=None, help="folder for the step's stdout and stderr")
    argv = sys.argv[1:]
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        parser.error("the step's command comes after --")
    args = parser.parse_args(argv[: argv.index("--")])
    command = argv[argv.index("--") + 1 :]
    logs = args.logs or Path(tempfile.mkdtemp(prefix="llmops-step-"))
    line, status = run(args.name, args.limit, command, logs)
    print(json.dumps(line), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
