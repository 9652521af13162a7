"""Files and folders the user cannot read or write: one line naming each, exit 2, never a traceback, and never a
folder's files passed over without a word."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# each case starts the command in a process of its own
pytestmark = pytest.mark.slow

LLMOPS = [sys.executable, "-m", "llmops.cli.app"]
ROW = '{"instruction": "Say hi", "output": "hi"}\n'


def as_a_user(command: list[str]) -> list[str]:
    """Root reads any file whatever its mode: the command runs without the capabilities that let it, as a user."""
    if os.geteuid() != 0:
        return command
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: a file's mode cannot stop a read")
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--", *command]


def run(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LLMOPS_HOME": str(project / "home")}
    return subprocess.run(as_a_user([*LLMOPS, *args]), cwd=project, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    (tmp_path / "data" / "sub").mkdir(parents=True)
    (tmp_path / "data" / "a.jsonl").write_text(ROW)
    (tmp_path / "data" / "sub" / "b.jsonl").write_text(ROW)
    (tmp_path / "c.yaml").write_text("data: {path: data, kind: instruction}\n")
    return tmp_path


def one_line_refusal(done: subprocess.CompletedProcess[str]) -> str:
    message = (done.stdout + done.stderr).strip()
    assert done.returncode == 2 and "\n" not in message and "Traceback" not in message, message
    return message


def test_an_unreadable_config_data_file_or_subfolder_is_one_line(project: Path) -> None:
    config, data_file, folder = project / "c.yaml", project / "data" / "sub" / "b.jsonl", project / "data" / "sub"
    config.chmod(0)
    assert one_line_refusal(run(project, "plan", "c.yaml")) == \
        "error: c.yaml: cannot read the config file (Permission denied)"
    config.chmod(0o644)
    data_file.chmod(0)
    assert one_line_refusal(run(project, "plan", "c.yaml")) == \
        f"error: data source 'data': cannot read {data_file} (Permission denied)"
    data_file.chmod(0o644)
    # Path.rglob passed over a folder it could not list: its rows were gone without a word
    folder.chmod(0)
    try:
        assert one_line_refusal(run(project, "plan", "c.yaml")) == \
            f"error: data source 'data': cannot list {folder} (Permission denied)"
    finally:
        folder.chmod(0o755)
    assert run(project, "plan", "c.yaml").returncode == 0


def test_writing_the_resolved_config_onto_a_folder_is_one_line(project: Path) -> None:
    assert one_line_refusal(run(project, "config", "c.yaml", "-o", "data")) == \
        "error: cannot write data (Is a directory)"
