"""The benchmarks' private workspace: a folder of their own, so no run touches the project's `.llmops`."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def bench_workspace(workdir: str | None = None) -> Path:
    """Called inside each script's `try`: on a machine that lacks a package it fails as that script's JSON line."""
    folder = Path(workdir or tempfile.mkdtemp(prefix="llmops-bench-"))
    os.environ["LLMOPS_HOME"] = str(folder / "home")
    from llmops.cli.environment import configure_environment

    configure_environment()
    return folder
