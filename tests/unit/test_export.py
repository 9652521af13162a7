"""`llmops models export`: the refusals, in one line (a registered version exported as a folder that from_pretrained
loads, with the same logits: tests/integration/test_export_e2e.py)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from llmops.cli.app import app

runner = CliRunner()


def test_export_refuses_a_folder_with_files_and_an_unknown_model(tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    unknown = runner.invoke(app, ["models", "export", "nothing@champion", str(tmp_path / "new")])
    assert unknown.exit_code == 2 and "no registered model 'nothing'" in unknown.output
    full = runner.invoke(app, ["models", "export", "nothing@champion", str(tmp_path / "full")])
    assert full.exit_code == 2 and "is not empty" in full.output
