"""The workspace: where a run keeps its state (LLMOPS_HOME): artifacts' places, locks and the fingerprint cache.

All generated state lives under one folder, `.llmops` in the project unless LLMOPS_HOME says
otherwise: artifacts, the MLflow store of the embedded default, DVC's cache and records, locks.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from llmops.io.files import hash_file, project_root

# a stage name, a key, a record's name: one path component inside the workspace, never "..", "/" or "~"
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def home() -> Path:
    """All generated state lives here: LLMOPS_HOME, default `.llmops` in the project."""
    configured = os.environ.get("LLMOPS_HOME")
    path = Path(configured) if configured else project_root() / ".llmops"
    return path.resolve()


def hash_file_cached(path: Path) -> str:
    """A file's hash, remembered by its size and modification time: large data and base models are read once."""
    stat = path.stat()
    return remembered("file-hashes", f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ino}",
                      lambda: hash_file(path))


def remembered(cache: str, entry: str, compute: Callable[[], Any]) -> Any:
    """A JSON value remembered in the workspace's cache file `cache` under `entry`, which must name everything the
    value depends on: computed once, then read (what a plan asks stage after stage, run after run)."""
    cache_file = home() / "cache" / f"{cache}.json"
    try:
        values = json.loads(cache_file.read_text()) if cache_file.is_file() else {}
    except (OSError, ValueError):  # a cache is never worth a failed run: start it again
        values = {}
    if entry in values:
        return values[entry]
    value = values[entry] = compute()
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    scratch = cache_file.with_name(f"{cache_file.name}.{uuid.uuid4().hex[:8]}")
    scratch.write_text(json.dumps(values))
    os.replace(scratch, cache_file)  # concurrent runs may drop each other's entries, never corrupt the file
    return value


def safe_name(name: str, what: str = "name") -> str:
    """`name` when it can only name something inside its folder; a ValueError otherwise."""
    if not SAFE_NAME.fullmatch(name) or ".." in name:
        raise ValueError(f"{what} {name!r} cannot name a file in the workspace: use letters, digits, '_', '.' "
                         "and '-' only")
    return name


def artifact_dir(stage: str, key: str) -> Path:
    return home() / "artifacts" / safe_name(stage, "stage name") / safe_name(key, "artifact key")


@contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `lock_path`: two runs never build one key at once."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def records_dir() -> Path:
    return home() / "records"


def write_record(name: str, content: str) -> Path:
    folder = records_dir()
    folder.mkdir(parents=True, exist_ok=True)
    return write_atomically(folder / f"{safe_name(name)}.json", content)


def write_atomically(path: Path, content: str) -> Path:
    """Readers (a concurrent run, `dvc status`) see the old bytes or the new ones, never half of them."""
    scratch = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    try:
        scratch.write_text(content)
        os.replace(scratch, path)
    finally:
        scratch.unlink(missing_ok=True)
    return path
