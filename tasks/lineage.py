"""Where a model came from: git commit, DVC data version, config hash, flow run."""

from __future__ import annotations

import subprocess
from pathlib import Path

from pydantic import BaseModel

from tasks.versions import DataVersion
from tasks.workspace import StageRecord


class Lineage(BaseModel):
    git_commit: str
    git_dirty: bool
    data: DataVersion
    # the hash of the data files themselves, tracked by DVC or not
    data_sha256: str
    config_hash: str
    flow_run_id: str

    def tags(self) -> dict[str, str]:
        return {
            "git_commit": self.git_commit,
            "git_dirty": str(self.git_dirty).lower(),
            "dvc_data_md5": self.data.dvc_md5 or "untracked",
            "dvc_file": self.data.dvc_file or "",
            "data_matches_dvc": str(self.data.matches_dvc).lower(),
            "data_sha256": self.data_sha256,
            "config_hash": self.config_hash,
            "prefect_flow_run_id": self.flow_run_id,
        }


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


def collect_lineage(config_hash: str, ingested: StageRecord, flow_run_id: str, root: Path) -> Lineage:
    commit, dirty = git_state(root)
    data = DataVersion(**{k: ingested.stats.get(k) for k in DataVersion.model_fields})
    return Lineage(git_commit=commit, git_dirty=dirty, data=data, data_sha256=ingested.stats["data_sha256"],
                   config_hash=config_hash, flow_run_id=flow_run_id)
