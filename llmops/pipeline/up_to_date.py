"""An unchanged run: when every stage's artifact is in the workspace under the key the config plans now, with
its files as the last run of these keys left them, and that run registered a version that the registry still
holds (registry/presence.py asks), running again would change nothing.

`llmops run` then says so in about a second, as `dvc repro` does, without starting Prefect's API,
MLflow or DVC (tens of seconds for nothing); `--force` runs the flow anyway.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmops.config.schema import PipelineConfig
from llmops.io.files import project_root
from llmops.pipeline.runner import plan, planned
from llmops.store.workspace import artifact_dir, home, write_atomically


def last_run_file() -> Path:
    """Beside the caches: losing it costs one run of the flow, nothing else (DVC's records folder holds only the
    stages' records)."""
    return home() / "cache" / "last-run.json"


def remember_run(config: PipelineConfig, summary: dict[str, Any]) -> None:
    """What a finished run made, by the keys it planned: the next run of the same keys is this one again."""
    keys = plan(config, project_root())
    last_run_file().parent.mkdir(parents=True, exist_ok=True)
    write_atomically(last_run_file(), json.dumps({"keys": keys, "files": file_stats(keys), "summary": summary},
                                                 indent=2, default=str))


def file_stats(keys: dict[str, str]) -> dict[str, list[int]]:
    """Every artifact file's size and modification time: a file changed since the last run (a flipped byte, a
    restored backup) sends the run through the flow, which checks each artifact against its manifest's hashes."""
    found: dict[str, list[int]] = {}
    for stage, key in keys.items():
        folder = artifact_dir(stage, key)
        for path in sorted(folder.rglob("*")) if folder.is_dir() else []:
            if path.is_file():
                stat = path.stat()
                found[str(path.relative_to(folder.parent.parent))] = [stat.st_size, stat.st_mtime_ns]
    return found


def unchanged_stages(config: PipelineConfig) -> dict[str, Any] | None:
    """The last run's summary, every stage reused, when the plan of `config` is that run's, every stage's artifact
    in the workspace and its files as that run left them; None otherwise (or when that cannot be told cheaply).
    Whether its version is still registered is the registry's to say (registry/presence.py)."""
    path = last_run_file()
    if not path.is_file():
        return None
    try:
        last = json.loads(path.read_text())
    except (OSError, ValueError):  # half a file from a crash: the flow runs and writes it again
        return None
    rows = planned(config)
    keys = {name: key for name, key, _ in rows}
    if any(state == "computed" for _, _, state in rows) or keys != last.get("keys") or \
            file_stats(keys) != last.get("files"):
        return None
    return {**last["summary"], "stages": {name: "reused" for name in last["keys"]}}
