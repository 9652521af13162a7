import json
from pathlib import Path

from typer.testing import CliRunner

from llmops.flows.cli.app import app

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
