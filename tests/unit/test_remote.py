"""The shared artifact store (workspace.remote) on a folder: pull before build, push after, verify every download."""

import json
import logging
import shutil
import time
from pathlib import Path

import pytest

from llmops.io.figures import Figures
from llmops.io.files import hash_file
from llmops.store import artifacts
from llmops.store.artifacts import StageRecord
from llmops.store.shared import FsspecStore


class Rows(Figures):
    rows: int


RowsRecord = StageRecord[Rows]


def builder(calls: list[str], name: str, text: str = "hello"):
    def build(folder: Path) -> Rows:
        calls.append(name)
        (folder / "out.txt").write_text(text)
        (folder / "nested").mkdir()
        (folder / "nested" / "weights.bin").write_bytes(b"\x00\x01" * 100)
        return Rows(rows=2)
    return build


def in_home(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    monkeypatch.setenv("LLMOPS_HOME", str(folder))


def build(store: FsspecStore, calls: list[str], name: str, key: str = "k1", upstream=()) -> RowsRecord:
    with artifacts.sharing(store):
        return artifacts.build_artifact(RowsRecord, "demo", key, builder(calls, name), list(upstream))


def test_a_second_workspace_pulls_instead_of_building(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = FsspecStore(str(tmp_path / "remote"))
    calls: list[str] = []
    in_home(monkeypatch, tmp_path / "a")
    built = build(store, calls, "a")
    published = tmp_path / "remote" / "demo" / "k1"
    assert sorted(p.relative_to(published).as_posix() for p in published.rglob("*") if p.is_file()) == [
        ".claim", "manifest.json", "nested/weights.bin", "out.txt", "record.json"]  # the claim: who published it

    in_home(monkeypatch, tmp_path / "b")
    pulled = build(store, calls, "b")
    assert calls == ["a"]  # nothing recomputed
    assert pulled.reused and pulled.hash == built.hash and pulled.figures == built.figures
    assert pulled.dir == tmp_path / "b" / "artifacts" / "demo" / "k1"
    assert (pulled.dir / "nested" / "weights.bin").read_bytes() == b"\x00\x01" * 100
    assert artifacts.verify(pulled.dir) is None
    assert not list(pulled.dir.parent.glob("k1.pull-*"))  # the private download folder is gone


def test_a_corrupted_remote_file_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    store = FsspecStore(str(tmp_path / "remote"))
    calls: list[str] = []
    in_home(monkeypatch, tmp_path / "a")
    built = build(store, calls, "a")
    remote_file = tmp_path / "remote" / "demo" / "k1" / "nested" / "weights.bin"
    remote_file.write_bytes(b"\x00\x02" * 100)

    in_home(monkeypatch, tmp_path / "b")
    with caplog.at_level(logging.WARNING, logger="llmops.workspace"):
        rebuilt = build(store, calls, "b")
    assert calls == ["a", "b"] and not rebuilt.reused and rebuilt.hash == built.hash
    assert any("in the shared store is not used (1 file(s) differ from the manifest, e.g. nested/weights.bin)"
               in r.message for r in caplog.records)
    assert (rebuilt.dir / "nested" / "weights.bin").read_bytes() == b"\x00\x01" * 100
    # the copy built here replaced the bad one, which a third workspace then pulls
    assert remote_file.read_bytes() == b"\x00\x01" * 100
    in_home(monkeypatch, tmp_path / "c")
    assert build(store, calls, "c").reused and calls == ["a", "b"]


def test_a_remote_record_that_does_not_match_its_files_is_not_used(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A manifest rewritten to fit a changed file still fails: the record's content hash is of the old files."""
    store = FsspecStore(str(tmp_path / "remote"))
    calls: list[str] = []
    in_home(monkeypatch, tmp_path / "a")
    build(store, calls, "a")
    published = tmp_path / "remote" / "demo" / "k1"
    (published / "out.txt").write_text("forged")
    manifest = json.loads((published / "manifest.json").read_text())
    manifest["out.txt"] = hash_file(published / "out.txt")
    (published / "manifest.json").write_text(json.dumps(manifest))
    in_home(monkeypatch, tmp_path / "b")
    assert not build(store, calls, "b").reused and calls == ["a", "b"]


def test_a_remote_artifact_of_other_upstream_bytes_is_not_used(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    store = FsspecStore(str(tmp_path / "remote"))
    calls: list[str] = []
    up = RowsRecord(stage="up", key="u", hash="h1", figures=Rows(rows=1))
    in_home(monkeypatch, tmp_path / "a")
    build(store, calls, "a", upstream=[up])
    in_home(monkeypatch, tmp_path / "b")
    again = build(store, calls, "b", upstream=[up.model_copy(update={"hash": "h2"})])
    assert calls == ["a", "b"] and again.upstream == {"up": "h2"}


def test_an_artifact_reused_here_is_pushed_when_the_remote_lacks_it(tmp_path: Path) -> None:
    calls: list[str] = []
    record = artifacts.build_artifact(RowsRecord, "demo", "k1", builder(calls, "local"))  # no remote yet
    store = FsspecStore(str(tmp_path / "remote"))
    assert not store.has("demo", "k1")
    assert build(store, calls, "again").reused and calls == ["local"]
    assert store.has("demo", "k1") and record.hash == build(store, calls, "again").hash


def test_ensure_local_brings_an_upstream_artifact_built_elsewhere(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    store = FsspecStore(str(tmp_path / "remote"))
    in_home(monkeypatch, tmp_path / "a")
    record = build(store, [], "a")
    in_home(monkeypatch, tmp_path / "b")
    assert not record.dir.exists()  # the record's folder is in this workspace now
    with artifacts.sharing(store):
        artifacts.ensure_local(record)
    assert (record.dir / "out.txt").read_text() == "hello" and artifacts.verify(record.dir) is None
    forged = record.model_copy(update={"hash": "another"})
    in_home(monkeypatch, tmp_path / "c")
    with artifacts.sharing(store), pytest.raises(FileNotFoundError, match="neither in .* nor, intact, in the shared"):
        artifacts.ensure_local(forged)


def test_a_handoff_is_read_once(tmp_path: Path) -> None:
    store = FsspecStore(f"file://{tmp_path / 'remote'}")
    store.hand_over("run-1", '{"record": 1}')
    assert store.take_over("run-1") == '{"record": 1}'
    with pytest.raises(FileNotFoundError, match="run run-1 left no stage record"):
        store.take_over("run-1")


def test_a_stage_refused_on_its_worker_is_not_sent_again_and_a_failed_one_is(tmp_path: Path) -> None:
    """The worker side leaves the one-line reason of a user error (config, data, its own setup) for the sender,
    which ends with it and does not retry; a bug, an interrupt of the machine or a server that can come back leaves
    nothing, and the run's final state is a failure its retries send again."""
    from prefect.states import Crashed, Failed

    from llmops.flows.remote import RemoteStageFailed, RemoteStageRefused, failure, refusal_handed_over
    from llmops.io.errors import ConfigError, worth_retrying
    from llmops.tracking.log import TrackingUnavailableError

    store = FsspecStore(f"file://{tmp_path / 'remote'}")
    where = "train on work pool gpu: flow run calm-fox"
    with pytest.raises(ConfigError), refusal_handed_over(store, "run-1"):
        raise ConfigError("train.processes=4 but this machine has 1 GPU(s)")
    refused = failure(where, Failed(message="Flow run encountered an exception"), store, "run-1")
    assert isinstance(refused, RemoteStageRefused) and not worth_retrying(refused)
    assert str(refused) == ("train on work pool gpu: flow run calm-fox failed on its worker: train.processes=4 but "
                            "this machine has 1 GPU(s)")
    for error in (RuntimeError("a bug"), TrackingUnavailableError("the tracking server is down")):
        with pytest.raises(type(error)), refusal_handed_over(store, "run-2"):
            raise error
        failed = failure(where, Failed(message="Flow run encountered an exception"), store, "run-2")
        assert isinstance(failed, RemoteStageFailed) and worth_retrying(failed)
        assert str(failed) == f"{where} ended Failed: Flow run encountered an exception"
    # the refusal was read once: a later failure of the same run is its state
    assert isinstance(failure(where, Crashed(message="no heartbeat"), store, "run-1"), RemoteStageFailed)


def machine_folder(tmp_path: Path, name: str) -> Path:
    """An artifact as one machine built it: the same content, bookkeeping of its own (a library's random id)."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "data.txt").write_text("same rows")
    (folder / "state.json").write_text(json.dumps({"fingerprint": name}))
    (folder / "manifest.json").write_text(json.dumps({"data.txt": "h", "state.json": name}))
    (folder / "record.json").write_text(json.dumps({"by": name}))
    return folder


def test_one_machine_publishes_a_key_and_another_leaves_it_to_the_claim_holder(tmp_path: Path) -> None:
    """Two machines that built the same data stage at once would write one folder file by file, mixing one's
    bookkeeping with the other's manifest: the second finds the claim taken and sends nothing."""
    first, second = FsspecStore(str(tmp_path / "remote")), FsspecStore(str(tmp_path / "remote"))
    assert first.upload(machine_folder(tmp_path, "a"), "demo", "k1")
    assert not second.upload(machine_folder(tmp_path, "b"), "demo", "k1")
    published = tmp_path / "remote" / "demo" / "k1"
    assert {p.name: p.read_text() for p in published.iterdir() if p.name != ".claim"} == {
        name: (tmp_path / "a" / name).read_text() for name in ("data.txt", "state.json", "manifest.json",
                                                              "record.json")}
    second.discard("demo", "k1")  # found bad: the claim goes with the record, so a rebuilt copy replaces it
    first.discard("demo", "k1")  # the other machine found it bad too, a moment later: nothing left to remove
    assert second.upload(machine_folder(tmp_path, "c"), "demo", "k1")
    assert json.loads((published / "record.json").read_text()) == {"by": "c"}
    assert first.download("demo", "k1", tmp_path / "pulled")  # the claim is the store's: it does not come along
    assert sorted(p.name for p in (tmp_path / "pulled").iterdir()) == ["data.txt", "manifest.json", "record.json",
                                                                     "state.json"]
    shutil.rmtree(published)  # removed by hand (or by the bucket's expiry rule): the claim went with it
    assert second.upload(machine_folder(tmp_path, "d"), "demo", "k1") and second.has("demo", "k1")


def test_a_crashed_upload_gives_up_its_claim_and_a_stale_claim_is_taken_over(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = FsspecStore(str(tmp_path / "remote"))
    folder = machine_folder(tmp_path, "a")

    def lost_connection(*args: object, **kwargs: object) -> None:
        raise ConnectionError("connection reset")

    with monkeypatch.context() as patch:
        patch.setattr(store.fs, "put_file", lost_connection)
        with pytest.raises(ConnectionError):
            store.upload(folder, "demo", "k1")
    assert not store.has("demo", "k1") and not Path(store.claim_path("demo", "k1")).exists()

    def claimed(key: str, note: str) -> None:
        Path(store.claim_path("demo", key)).parent.mkdir(parents=True)
        Path(store.claim_path("demo", key)).write_text(note)

    claimed("k2", json.dumps({"host": "gone", "at": 0.0}))  # a machine that died while sending k2
    assert store.upload(folder, "demo", "k2") and store.has("demo", "k2")
    claimed("k4", "{}")  # unreadable: nothing to wait for
    assert store.upload(folder, "demo", "k4") and store.has("demo", "k4")
    claimed("k3", json.dumps({"host": "busy", "at": time.time()}))  # a machine sending k3 right now
    assert not store.upload(folder, "demo", "k3") and not store.has("demo", "k3")


@pytest.fixture
def no_aws_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """S3 with no credentials anywhere botocore looks (variables, files, the instance metadata service)."""
    import os

    for name in [name for name in os.environ if name.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.mark.usefixtures("no_aws_credentials")
def test_what_the_storage_library_refuses_is_one_line_naming_the_setting(tmp_path: Path) -> None:
    """botocore's own errors (here: no credentials) are not OS errors; they still end the run in one line."""
    from llmops.io.errors import Transient, UserError
    from llmops.store.shared import SharedStoreError
    from llmops.training.checkpoints import CheckpointStoreError, download_latest

    with pytest.raises(SharedStoreError) as raised:
        FsspecStore("s3://team-bucket/artifacts").has("ingest", "k1")
    assert str(raised.value) == ("workspace.remote s3://team-bucket/artifacts: NoCredentialsError: Unable to locate "
                                 "credentials (check the URL, that the bucket exists, the credentials and the "
                                 "endpoint, e.g. AWS_ENDPOINT_URL)")
    assert isinstance(raised.value, UserError) and isinstance(raised.value, Transient)
    with pytest.raises(CheckpointStoreError, match=r"^train.checkpoint_dir s3://team-bucket/checkpoints: "
                                                   r"NoCredentialsError: Unable to locate credentials \(check"):
        download_latest("s3://team-bucket/checkpoints", "k1", tmp_path)
    with pytest.raises(FileNotFoundError):  # an OS error is an answer the callers act on, as it was
        FsspecStore(str(tmp_path / "store")).take_over("run-1")
