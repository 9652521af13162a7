import logging
import threading
from pathlib import Path

import pytest

from llmops.io.errors import StorageFullError, UserError
from llmops.io.figures import Figures
from llmops.io.files import hash_file, hash_json, hash_tree
from llmops.store import artifacts
from llmops.store.artifacts import StageRecord


class Rows(Figures):
    rows: int


RowsRecord = StageRecord[Rows]


def build_once(calls: list[Path], text: str = "hello"):
    def build(folder: Path) -> Rows:
        calls.append(folder)
        (folder / "out.txt").write_text(text)
        return Rows(rows=1)
    return build


def test_artifact_is_built_once_then_reused(home: Path) -> None:
    calls: list[Path] = []
    first = artifacts.build_artifact(RowsRecord, "demo", "k1", build_once(calls))
    second = artifacts.build_artifact(RowsRecord, "demo", "k1", build_once(calls))
    assert len(calls) == 1
    assert not first.reused and second.reused
    assert second.figures == Rows(rows=1) and second.dir == home / "artifacts" / "demo" / "k1"
    assert (second.dir / "out.txt").read_text() == "hello"
    assert second.hash == first.hash == hash_json({"out.txt": hash_file(second.dir / "out.txt")})


def test_failed_build_leaves_nothing_to_reuse(home: Path) -> None:
    def broken(folder: Path) -> Rows:
        (folder / "half.txt").write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(StorageFullError,
                       match="demo artifact k2: No space left on device .*nothing of it was kept") as err:
        artifacts.build_artifact(RowsRecord, "demo", "k2", broken)
    assert isinstance(err.value, UserError)  # the CLI shows it in one line
    stage_dir = home / "artifacts" / "demo"
    assert [p.name for p in stage_dir.iterdir()] == ["k2.lock"]
    assert artifacts.load_record(RowsRecord, stage_dir / "k2") is None


def test_resumable_build_keeps_its_partial_folder(home: Path) -> None:
    def broken(folder: Path) -> Rows:
        (folder / "checkpoint").write_text("step 10")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        artifacts.build_artifact(RowsRecord, "demo", "k3", broken, resumable=True)
    seen = []

    def resume(folder: Path) -> Rows:
        seen.append((folder / "checkpoint").read_text())
        return Rows(rows=0)

    artifacts.build_artifact(RowsRecord, "demo", "k3", resume, resumable=True)
    assert seen == ["step 10"]
    assert (home / "artifacts" / "demo" / "k3" / "record.json").is_file()


def test_a_flipped_byte_is_caught_on_reuse_and_rebuilt(home: Path, caplog: pytest.LogCaptureFixture) -> None:
    calls: list[Path] = []
    first = artifacts.build_artifact(RowsRecord, "demo", "k4", build_once(calls))
    stored = first.dir / "out.txt"
    stored.write_bytes(b"jello")
    with caplog.at_level(logging.WARNING, logger="llmops.workspace"):
        again = artifacts.build_artifact(RowsRecord, "demo", "k4", build_once(calls))
    assert len(calls) == 2 and not again.reused and stored.read_text() == "hello"
    assert any("1 file(s) differ from the manifest, e.g. out.txt" in r.message for r in caplog.records)
    assert len(list((home / "artifacts" / "demo").glob("k4.rejected-*"))) == 1  # kept for a person to look at


def test_an_artifact_built_from_other_upstream_bytes_is_rebuilt(home: Path) -> None:
    calls: list[Path] = []
    up = RowsRecord(stage="up", key="u", hash="h1", figures=Rows(rows=1))
    artifacts.build_artifact(RowsRecord, "demo", "k5", build_once(calls), [up])
    assert artifacts.build_artifact(RowsRecord, "demo", "k5", build_once(calls), [up]).reused
    rebuilt_upstream = up.model_copy(update={"hash": "h2"})
    again = artifacts.build_artifact(RowsRecord, "demo", "k5", build_once(calls), [rebuilt_upstream])
    assert not again.reused and again.upstream == {"up": "h2"} and len(calls) == 2


def test_two_builders_of_one_key_build_it_once(home: Path) -> None:
    calls: list[Path] = []
    started = threading.Event()

    def slow(folder: Path) -> Rows:
        started.set()
        calls.append(folder)
        threading.Event().wait(0.5)
        (folder / "out.txt").write_text("x")
        return Rows(rows=1)

    results = []
    first = threading.Thread(target=lambda: results.append(artifacts.build_artifact(RowsRecord, "demo", "k6", slow)))
    first.start()
    started.wait(5)
    second = artifacts.build_artifact(RowsRecord, "demo", "k6", slow)
    first.join()
    assert len(calls) == 1 and second.reused and not results[0].reused


def test_hash_tree_depends_on_names_and_bytes(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("1")
    first = hash_tree(tmp_path)
    (tmp_path / "a").rename(tmp_path / "b")
    assert hash_tree(tmp_path) != first
