"""A module's imports are read from its source even when another thread's parse trips CPython 3.11's shared AST
recursion counter ("AST constructor recursion depth mismatch"): the parse is tried again."""

from __future__ import annotations

import ast

import pytest

from llmops.pipeline import keys

# a source of this test's own: not in the parse cache yet
SOURCE = "import llmops.io.shards\nfrom llmops.text import packing\n# test_code_parse\n"


def test_a_parse_that_fails_by_the_thread_race_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = ast.parse

    def racing(source: str, *args: object, **kwargs: object) -> ast.Module:
        if source == SOURCE:
            calls.append(source)
            if len(calls) == 1:
                raise SystemError("AST constructor recursion depth mismatch (before=168, after=71)")
        return real(source, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(keys.ast, "parse", racing)
    found = sorted(keys.imports_in(SOURCE, "llmops.core"))
    assert found == ["llmops.io.shards", "llmops.text", "llmops.text.packing"]
    assert len(calls) == 2


def test_a_parse_that_keeps_failing_is_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    real = ast.parse

    def broken(source: str, *args: object, **kwargs: object) -> ast.Module:
        if source == "x = 1\n":
            raise SystemError("AST constructor recursion depth mismatch")
        return real(source, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(keys.ast, "parse", broken)
    with pytest.raises(SystemError):
        keys.parsed("x = 1\n")
