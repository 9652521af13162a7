"""Where a model came from: git commit, DVC data version, config hash, flow run; and the same facts as MLflow's own
conventions name them (source tags, datasets), so that its UI shows them where users look."""

from __future__ import annotations

import getpass
import json
import subprocess
from pathlib import Path

from pydantic import BaseModel

from llmops.config.schema import PipelineConfig
from llmops.data.ingest import IngestRecord, locate_all
from llmops.data.versions import DataVersion, data_version, pin_of
from llmops.io.tables import INDEX, table_index
from llmops.tracking.log import LoggedDataset


class Lineage(BaseModel):
    git_commit: str
    git_dirty: bool
    data: DataVersion
    # the hash of the data files themselves, tracked by DVC or not
    data_sha256: str
    config_hash: str
    flow_run_id: str
    # the event that started the run (trigger_event_id, trigger_event); empty when started by hand or schedule
    trigger: dict[str, str] = {}

    def tags(self) -> dict[str, str]:
        return {
            **self.trigger,
            "git_commit": self.git_commit,
            "git_dirty": str(self.git_dirty).lower(),
            "dvc_data_md5": self.data.dvc_md5 or "untracked",
            "dvc_file": self.data.dvc_file or "",
            "data_matches_dvc": str(self.data.matches_dvc).lower(),
            "data_sha256": self.data_sha256,
            "config_hash": self.config_hash,
            "prefect_flow_run_id": self.flow_run_id,
        }

    def card_section(self) -> str:
        """The data and code version, for the model's card."""
        pinned = f"`{self.data.dvc_file}` md5 `{self.data.dvc_md5}`" if self.data.dvc_file else "not pinned by DVC"
        differs = " (the files on disk differ from the pin)" if self.data.matches_dvc is False else ""
        return (f"\n## Versions\n\nData: {pinned}{differs}; sha256 of the data files `{self.data_sha256[:16]}`. "
                f"Code: git `{self.git_commit[:12]}`{' (with uncommitted changes)' if self.git_dirty else ''}. "
                f"Config hash `{self.config_hash[:16]}`.\n")


def git_state(root: Path) -> tuple[str, bool]:
    """The commit checked out at `root` and whether tracked files differ from it."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown", False
    return commit, bool(status.strip())


def collect_lineage(config: PipelineConfig, ingested: IngestRecord, flow_run_id: str, root: Path,
                    trigger: dict[str, str] | None = None) -> Lineage:
    """Read now, not at ingest: `dvc add` may have pinned the same bytes since the data was read."""
    commit, dirty = git_state(root)
    first = next((files[0] for _, _, files in locate_all(config.data, root) if files), None)
    data = data_version(first, root) if first is not None else DataVersion()
    return Lineage(git_commit=commit, git_dirty=dirty, data=data, data_sha256=ingested.figures.data_sha256,
                   config_hash=config.digest(), flow_run_id=flow_run_id, trigger=trigger or {})


def source_tags(entry: str, root: Path, scheduled: bool) -> dict[str, str]:
    """MLflow's source tags for a run started by `entry` (a flow, a command): its code's commit, what started it
    and whether it ran as a job (a deployment) or by hand."""
    commit, _ = git_state(root)
    tags = {"mlflow.source.name": entry, "mlflow.source.type": "JOB" if scheduled else "LOCAL",
            "mlflow.user": getpass.getuser()}
    return {**tags, "mlflow.source.git.commit": commit} if commit != "unknown" else tags


def split_datasets(config: PipelineConfig, folder: Path, splits: tuple[tuple[str, str], ...], key: str,
                   root: Path) -> list[LoggedDataset]:
    """The splits a stage wrote (table, MLflow context) as MLflow datasets: named by the data and the split, their
    source the data's sources with the DVC file pinning each, their digest the DVC md5 (the split's own content key
    where the data is not pinned)."""
    located = [(source, pin_of(files[0], root) if files else DataVersion())
               for source, _, files in locate_all(config.data, root)]
    md5 = next((version.dvc_md5 for _, version in located if version.dvc_md5), None)
    described = json.dumps([{**source.model_dump(include={"path", "name", "subset", "split", "revision"},
                                                 exclude_none=True),
                             **({"dvc_file": version.dvc_file, "dvc_md5": version.dvc_md5} if version.dvc_file else {})}
                            for source, version in located])
    first = located[0][0] if located else None
    stem = Path(str(first.path or first.name)).stem if first is not None else "data"
    return [LoggedDataset(name=f"{stem}-{table}", digest=md5 or key, source_type="dvc" if md5 else "local",
                          source=described, context=context, rows=table_index(folder / table)["rows"])
            for table, context in splits if (folder / table / INDEX).is_file()]
