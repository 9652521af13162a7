"""When data changes, retrain once: on complete data, and never twice on one data version.

Complete: data that matches its DVC pin was checked byte for byte by DVC; other data must have
stopped changing for a quiet period (a file still being copied keeps growing). Once: a version
already trained on this DVC md5 with this config means there is nothing to do, however many
events announced it and however many workers picked them up.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from llmops.config.schema import PipelineConfig
from llmops.data.ingest import locate_all
from llmops.data.versions import DataVersion, data_version
from llmops.tracking import log as tracking


def data_files(config: PipelineConfig, root: Path) -> list[Path]:
    return [path for _, _, files in locate_all(config.data, root) for path in files]


def pinned_version(config: PipelineConfig, root: Path) -> DataVersion:
    """The DVC version of the configured data (its first file's .dvc), and whether the disk matches it."""
    files = data_files(config, root)
    return data_version(files[0], root) if files else DataVersion()


def not_ready(config: PipelineConfig, root: Path, announced_md5: str | None, quiet_seconds: float,
              sleep: Callable[[float], None] = time.sleep) -> str | None:
    """Why the configured data must not start a run now, or None when it may."""
    version = pinned_version(config, root)
    if announced_md5 and version.dvc_md5 != announced_md5:
        pinned = f"{version.dvc_file} pins {version.dvc_md5}" if version.dvc_file else "the data is not pinned by DVC"
        return (f"the event announced data md5 {announced_md5}, but in this checkout {pinned}: commit and push the "
                ".dvc file, then `llmops data push`")
    if version.matches_dvc:
        return None  # DVC checked every byte against the pin: nothing is half-written
    if announced_md5:
        return f"the data on disk differs from {version.dvc_file}: `dvc pull` did not bring md5 {announced_md5}"
    changing = still_being_written(data_files(config, root), quiet_seconds, sleep)
    if changing is not None:
        return f"{changing} is still being written: it changed within the last {quiet_seconds:g}s"
    return None


def still_being_written(files: list[Path], quiet_seconds: float,
                        sleep: Callable[[float], None] = time.sleep) -> Path | None:
    """A file that changed within the last `quiet_seconds`, or while waiting for that long to pass; else None."""
    before = {path: signature(path) for path in files}
    newest = max((mtime for _, mtime in before.values()), default=0)
    wait = quiet_seconds - (time.time_ns() - newest) / 1e9
    if wait <= 0:
        return None
    sleep(wait)
    return next((path for path, seen in before.items() if signature(path) != seen), None)


def signature(path: Path) -> tuple[int, int]:
    try:
        stat = path.stat()
    except FileNotFoundError:
        return (-1, -1)
    return stat.st_size, stat.st_mtime_ns


def version_trained_on(config: PipelineConfig, md5: str) -> str | None:
    """The newest version of the configured model trained on DVC data md5 `md5` with this very config."""
    client = tracking.client(config.tracking)
    found = [version for version in client.search_model_versions(
        f"name = '{config.registry.model_name}' and tags.dvc_data_md5 = '{md5}'")
        if version.tags.get("config_hash") == config.digest()]
    return str(max(int(v.version) for v in found)) if found else None
