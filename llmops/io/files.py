"""The files a stage reads and writes, and how their bytes are hashed: what every artifact is made of.

Kept apart from the workspace (where state lives) because these functions shape an artifact's bytes
and its hashes, and so belong to the stages' keys; where a workspace is does not.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT_MARKERS = ("dvc.yaml", ".git")
def project_root(start: Path | None = None) -> Path:
    """The nearest folder at or above `start` that holds dvc.yaml or .git; else `start`."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if any((folder / marker).exists() for marker in ROOT_MARKERS):
            return folder
    return here


def hash_bytes_of(path: Path, digest: Any = None) -> Any:
    digest = digest or hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest


def hash_file(path: Path) -> str:
    return hash_bytes_of(path).hexdigest()


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
