from pathlib import Path

import pytest

from tasks import workspace
from tasks.workspace import StageRecord


def test_artifact_is_built_once_then_reused(home: Path) -> None:
    calls = []

    def build(folder: Path) -> tuple[str, dict]:
        calls.append(folder)
        (folder / "out.txt").write_text("hello")
        return "h1", {"rows": 1}

    first = workspace_build(build)
    second = workspace_build(build)
    assert len(calls) == 1
    assert not first.reused and second.reused
    assert second.stats == {"rows": 1} and Path(second.path).is_relative_to(home)
    assert (Path(second.path) / "out.txt").read_text() == "hello"


def workspace_build(build) -> StageRecord:
    return workspace.build_artifact("demo", "k1", build)


def test_failed_build_leaves_nothing_to_reuse(home: Path) -> None:
    def broken(folder: Path) -> tuple[str, dict]:
        (folder / "half.txt").write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        workspace.build_artifact("demo", "k2", broken)
    stage_dir = home / "artifacts" / "demo"
    assert list(stage_dir.iterdir()) == []
    assert workspace.load_record(stage_dir / "k2") is None


def test_resumable_build_keeps_its_partial_folder(home: Path) -> None:
    def broken(folder: Path) -> tuple[str, dict]:
        (folder / "checkpoint").write_text("step 10")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        workspace.build_artifact("demo", "k3", broken, resumable=True)
    seen = []

    def resume(folder: Path) -> tuple[str, dict]:
        seen.append((folder / "checkpoint").read_text())
        return "h", {}

    workspace.build_artifact("demo", "k3", resume, resumable=True)
    assert seen == ["step 10"]
    assert (home / "artifacts" / "demo" / "k3" / "record.json").is_file()


def test_stage_key_covers_config_upstream_code_and_extras() -> None:
    up = StageRecord(stage="ingest", key="a", path="/x", hash="h1")
    base = workspace.stage_key("s", {"a": 1}, [up], "code1", extra=1)
    assert base == workspace.stage_key("s", {"a": 1}, [up], "code1", extra=1)
    changed_upstream = up.model_copy(update={"hash": "h2"})
    variants = [
        workspace.stage_key("s", {"a": 2}, [up], "code1", extra=1),
        workspace.stage_key("s", {"a": 1}, [changed_upstream], "code1", extra=1),
        workspace.stage_key("s", {"a": 1}, [up], "code2", extra=1),
        workspace.stage_key("s", {"a": 1}, [up], "code1", extra=2),
    ]
    assert len({base, *variants}) == 5


def test_hash_tree_depends_on_names_and_bytes(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("1")
    first = workspace.hash_tree(tmp_path)
    (tmp_path / "a").rename(tmp_path / "b")
    assert workspace.hash_tree(tmp_path) != first
