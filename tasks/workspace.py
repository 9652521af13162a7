"""The content-addressed workspace: `<home>/artifacts/<stage>/<key>/`, written atomically.

A stage's key hashes its upstream artifacts' hashes, its config section and its code version,
so an unchanged input reuses the artifact and any change upstream yields a new key.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from pydantic import BaseModel, Field

RECORD_FILE = "record.json"
ROOT_MARKERS = ("dvc.yaml", ".git")


class StageRecord(BaseModel):
    """What a stage hands downstream: where its artifact is, its content hash and its figures."""

    stage: str
    key: str
    path: str
    hash: str
    stats: dict[str, Any] = Field(default_factory=dict)
    # not part of the stored record: set when an existing artifact is handed back
    reused: bool = Field(default=False, exclude=True)

    @property
    def dir(self) -> Path:
        return Path(self.path)


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


def hash_tree(root: Path) -> str:
    """Hash a file or a folder's files (relative names and bytes), in a stable order."""
    if root.is_file():
        return hash_file(root)
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        digest.update(rel.encode() + b"\0")
        hash_bytes_of(path, digest)
    return digest.hexdigest()


def hash_json(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def code_version(*modules: ModuleType) -> str:
    """The hash of the modules' source: editing a stage's code changes its key."""
    digest = hashlib.sha256()
    for module in modules:
        digest.update(Path(module.__file__ or "").read_bytes())
    return digest.hexdigest()[:16]


def stage_key(stage: str, config: BaseModel | dict[str, Any], upstream: Iterable[StageRecord], code: str,
              **extra: Any) -> str:
    config_json = config.model_dump(mode="json") if isinstance(config, BaseModel) else config
    material = {
        "stage": stage,
        "config": config_json,
        "upstream": {record.stage: record.hash for record in upstream},
        "code": code,
        "extra": extra,
    }
    return hash_json(material)[:24]


def artifact_dir(stage: str, key: str) -> Path:
    return home() / "artifacts" / stage / key


def load_record(folder: Path) -> StageRecord | None:
    path = folder / RECORD_FILE
    if not path.is_file():
        return None
    record = StageRecord.model_validate_json(path.read_text())
    record.path = str(folder)
    record.reused = True
    return record


Builder = Callable[[Path], tuple[str, dict[str, Any]]]


def build_artifact(stage: str, key: str, build: Builder, resumable: bool = False) -> StageRecord:
    """Return the artifact for `key`, building it first when it does not exist yet.

    `build(folder)` writes into a private folder and returns (content hash, stats); the folder
    is renamed into place only when complete, so a half-written artifact is never reused.
    A resumable build (training) keeps its partial folder across failures to resume from.
    """
    final = artifact_dir(stage, key)
    existing = load_record(final)
    if existing is not None:
        return existing
    if resumable:
        with exclusive(final.with_name(f"{key}.lock")):
            # a run that held the lock may have finished this very artifact meanwhile
            return load_record(final) or finish(stage, key, build, final, final.with_name(f"{key}.partial"), True)
    return finish(stage, key, build, final, final.with_name(f"{key}.tmp-{uuid.uuid4().hex[:8]}"), False)


@contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `lock_path`: two runs never write one resumable folder at once."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def finish(stage: str, key: str, build: Builder, final: Path, work: Path, resumable: bool) -> StageRecord:
    work.mkdir(parents=True, exist_ok=True)
    try:
        content_hash, stats = build(work)
    except BaseException:
        if not resumable:
            shutil.rmtree(work, ignore_errors=True)
        raise
    record = StageRecord(stage=stage, key=key, path=str(final), hash=content_hash, stats=stats)
    (work / RECORD_FILE).write_text(record.model_dump_json(indent=2))
    try:
        os.replace(work, final)
    except OSError:
        # another run finished the same key first: its artifact is equivalent
        shutil.rmtree(work, ignore_errors=True)
        return load_record(final) or record
    return record


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
