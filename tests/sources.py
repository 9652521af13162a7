"""The project's source files, for tests that read the code itself: recursive, and never silently empty."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def python_files(*folders: str) -> list[Path]:
    """Every .py file under these folders of the repository, recursively; fails when a folder holds none."""
    found: list[Path] = []
    for folder in folders:
        files = sorted((REPO / folder).rglob("*.py"))
        assert files, f"no Python file under {folder}/: a test that scans the sources would check nothing"
        found += files
    return found
