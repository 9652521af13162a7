import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from llmops.cli.app import app

runner = CliRunner()


def test_bad_config_key_is_one_line_and_exit_code_2() -> None:
    result = runner.invoke(app, ["run", "configs/default.yaml", "train.lr=0.1"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: configs/default.yaml (override train.lr=0.1): train.lr: "
                                                   "unknown key")


def test_missing_config_file(tmp_path: Path) -> None:
    result = runner.invoke(app, ["run", str(tmp_path / "none.yaml")])
    assert result.exit_code == 2 and "config file not found" in result.output


def test_models_list_on_an_empty_registry() -> None:
    result = runner.invoke(app, ["models", "list", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == []


def test_unknown_stage() -> None:
    result = runner.invoke(app, ["stage", "deploy"])
    assert result.exit_code == 2 and "unknown stage 'deploy'" in result.output


def test_deploy_needs_a_prefect_server(monkeypatch) -> None:
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    result = runner.invoke(app, ["deploy"])
    assert result.exit_code == 2
    assert result.output.strip().startswith("error: llmops deploy needs a Prefect server: set PREFECT_API_URL")


def test_sigusr1_prints_every_threads_stack_and_the_command_goes_on() -> None:
    script = ("import os, signal, threading, time\n"
              "from llmops.cli.app import dump_stacks_on_sigusr1\n"
              "dump_stacks_on_sigusr1()\n"
              "def waiting_in_a_thread(): time.sleep(5)\n"
              "threading.Thread(target=waiting_in_a_thread, daemon=True).start()\n"
              "os.kill(os.getpid(), signal.SIGUSR1)\n"
              "time.sleep(0.2)\n"
              "print('still running')\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout == "still running\n", result.stderr
    assert "waiting_in_a_thread" in result.stderr and "Current thread" in result.stderr
