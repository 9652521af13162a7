"""The workspace: where a run keeps its state (LLMOPS_HOME), and the files it hashes, reads and writes.

All generated state lives under one folder, `.llmops` in the project unless LLMOPS_HOME says
otherwise: artifacts, the MLflow store of the embedded default, DVC's cache and records, locks.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT_MARKERS = ("dvc.yaml", ".git")
# a stage name, a key, a record's name: one path component inside the workspace, never "..", "/" or "~"
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def project_root(start: Path | None = None) -> Path:
    """The nearest folder at or above `start` that holds dvc.yaml or .git; else `start`."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if any((folder / marker).exists() for marker in ROOT_MARKERS):
            return folder
    return here


def home() -> Path:
    """All generated state lives here: LLMOPS_HOME, default `.llmops` in the project."""
    configured = os.environ.get("LLMOPS_HOME")
    path = Path(configured) if configured else project_root() / ".llmops"
    return path.resolve()


def hash_bytes_of(path: Path, digest: Any = None) -> Any:
    digest = digest or hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest


def hash_file(path: Path) -> str:
    return hash_bytes_of(path).hexdigest()


def hash_file_cached(path: Path) -> str:
    """A file's hash, remembered by its size and modification time: large data and base models are read once."""
    stat = path.stat()
    entry = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ino}"
    cache_file = home() / "cache" / "file-hashes.json"
    cache = json.loads(cache_file.read_text()) if cache_file.is_file() else {}
    if entry in cache:
        return cache[entry]
    value = hash_file(path)
    cache[entry] = value
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    scratch = cache_file.with_name(f"{cache_file.name}.{uuid.uuid4().hex[:8]}")
    scratch.write_text(json.dumps(cache))
    os.replace(scratch, cache_file)  # concurrent runs may drop each other's entries, never corrupt the file
    return value


def hash_tree(root: Path) -> str:
    """Hash a file or a folder's files (relative names and bytes), in a stable order."""
    if root.is_file():
        return hash_file(root)
    return hash_json(file_hashes(root))


def file_hashes(root: Path, keep: Callable[[str], bool] = lambda _: True) -> dict[str, str]:
    return {path.relative_to(root).as_posix(): hash_file(path)
            for path in sorted(p for p in root.rglob("*") if p.is_file())
            if keep(path.relative_to(root).as_posix())}


def hash_json(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


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


def write_text_synced(path: Path, text: str) -> None:
    """Write and flush to disk: a record must never point at bytes that are not there."""
    with path.open("w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def load_dataset_dir(path: Path) -> Any:
    """A dataset saved in an artifact, read without ever writing into it: with caching off, `map` and the like
    write their results to a temporary folder, not beside the artifact's files (which would break its manifest)."""
    import datasets

    datasets.disable_caching()
    return datasets.load_from_disk(str(path))


def read_jsonl(path: Path) -> Iterable[dict[str, Any]]:
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                yield json.loads(line)


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> int:
    count = 0
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
            count += 1
    return count
