"""`llmops predict`: a registered version's errors and error rows (registered versions of each objective answering
through the CLI as their evaluation says: tests/integration/test_predict_e2e.py)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from llmops.cli.app import app
from llmops.config.schema import TrackingConfig
from llmops.io.files import read_jsonl
from tests.helpers import register_random_language_model, workspace_at

runner = CliRunner()


def predict(*args: str, stdin: str | bytes | None = None) -> Any:
    return runner.invoke(app, ["predict", *args], input=stdin)


@pytest.fixture(scope="module")
def random_version(registry: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random causal LM with the scratch chat template, registered as demo/1 @champion: nothing trained,
    no run config (predict falls back to the default lengths)."""
    with workspace_at(registry):
        register_random_language_model("demo", TrackingConfig(), tmp_path_factory.mktemp("random"))
    return "demo"


@pytest.mark.parametrize(("reference", "message"), [
    ("nope", "error: no registered model 'nope' in sqlite:///"),
    ("demo@prod", "error: demo has no alias 'prod' (aliases: @champion (version 1))"),
    ("demo/7", "error: demo has no version 7 (versions: 1)"),
])
def test_unknown_model_alias_or_version_is_one_line_and_exit_2(random_version: str, in_registry: Path,
                                                               reference: str, message: str) -> None:
    result = predict(reference, stdin='{"text": "row 1 says hello"}\n')
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), result.stderr


def test_bad_lines_become_error_rows_with_their_line_numbers(random_version: str, in_registry: Path,
                                                             tmp_path: Path) -> None:
    lines = [b'{"instruction": "Say hello.", "input": "row 1"}', b'{"instruction": "broken"', b"", b"[1, 2]",
             b'{"instruction": 5}', b'{"messages": [{"role": "assistant", "content": "hi"}]}',
             b'{"text": "row 3 says hello"}', b'{"text": "caf\xe9"}', b'{"prompt": "hello"}',
             b'{"messages": [{"role": "user", "content": "row 2"}, {"role": "assistant", "content": "hello"}]}',
             b'{"prefix": "row 4 says"}']
    (tmp_path / "rows.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    result = predict("demo", "--input", str(tmp_path / "rows.jsonl"), "--output", str(tmp_path / "out.jsonl"))
    assert result.exit_code == 1, result.output
    out = list(read_jsonl(tmp_path / "out.jsonl"))
    assert [row["line"] for row in out] == [1, 2, 4, 5, 6, 7, 8, 9, 10, 11]  # every row but the blank line
    errors = {row["line"]: row["error"] for row in out if "error" in row}
    assert set(errors) == {2, 4, 5, 6, 8, 9}
    assert errors[2].startswith("json_broken: not valid JSON")
    assert errors[4] == "not_object: a JSON array where an object is expected"
    assert errors[5] == "instruction: expected a string, got int" and errors[8] == "invalid UTF-8 at byte 13"
    assert "must end with a user turn" in errors[6] and errors[9].startswith("expected a field instruction")
    by_line = {row["line"]: row for row in out}
    assert isinstance(by_line[1]["output"], str) and "reference" not in by_line[1]
    assert by_line[10]["reference"] == "hello"
    assert math.isfinite(by_line[7]["perplexity"]) and by_line[7]["tokens"] > 1
    # a prefix is continued as raw text: no chat template, no stripping, at most the run's new tokens
    assert isinstance(by_line[11]["output"], str) and 0 <= by_line[11]["tokens"] <= 32
    assert "line 2: json_broken: not valid JSON" in result.stderr
    assert "6 rows could not be predicted (line 2, 4, 5, 6, 8, 9)" in result.stderr
