"""Usage errors (an unknown option or command, an option without its value) are user errors like any other: one
line and exit code 2, where Typer drew a box of several lines; help still prints as it does."""

import subprocess
import sys
from pathlib import Path

import pytest

# each case starts the command in a process of its own
pytestmark = pytest.mark.slow

LLMOPS = [sys.executable, "-m", "llmops.cli.app"]


def run(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LLMOPS, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("args", "expected"), [
    (("stage", "ingest", "--bogus"), "error: llmops stage: No such option: --bogus"),
    (("stage", "ingest", "-c"), "error: llmops: Option '-c' requires an argument."),
    (("nosuch",), "error: llmops: No such command 'nosuch'."),
    (("stage",), "error: llmops stage: Missing argument 'name'."),
])
def test_a_usage_error_is_one_line_and_exit_code_2(tmp_path: Path, args: tuple[str, ...], expected: str) -> None:
    done = run(tmp_path, *args)
    message = (done.stdout + done.stderr).strip()
    assert done.returncode == 2 and "\n" not in message and message.startswith(expected), message
    assert message.endswith("--help)")


def test_help_prints_in_full(tmp_path: Path) -> None:
    asked = run(tmp_path, "--help")
    assert asked.returncode == 0 and "Usage: llmops [OPTIONS] COMMAND [ARGS]..." in asked.stdout
    assert "plan" in asked.stdout and "stage" in asked.stdout
    bare = run(tmp_path, "models")
    assert "Usage: llmops models [OPTIONS] COMMAND [ARGS]..." in bare.stdout + bare.stderr
