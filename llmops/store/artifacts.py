"""The content-addressed workspace: `<home>/artifacts/<stage>/<key>/`, written atomically, verified on reuse.

An artifact is built in a private folder and renamed into place only when complete, with a
manifest of every file's hash. Reusing it checks the manifest (a changed byte means a rebuild,
with a warning) and that the upstream artifacts it was built from are still the ones in use.

While a shared store is in effect (`sharing`, set by the stage runner from `workspace.remote`), a
key missing here is looked for there before it is built, downloaded into a private folder, verified
the same way and renamed into place; and what is built or reused here is pushed there. The store
never enters a key: it decides where bytes are kept, not what they are.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Generic, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmops.io.errors import MissingInputError, StorageFullError
from llmops.io.figures import ONE_CPU, Compute, FiguresT
from llmops.io.files import file_hashes, hash_json, write_text_synced
from llmops.store.workspace import artifact_dir, exclusive

log = logging.getLogger("llmops.workspace")

RECORD_FILE = "record.json"
MANIFEST_FILE = "manifest.json"
# what a full disk (or a file size limit) looks like to a write
NO_SPACE = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
# how long a machine that took part in a multi-node build waits for the leading machine to publish the artifact
LEADER_WAIT_SECONDS = 1800.0


class StageRecord(BaseModel, Generic[FiguresT]):
    """What a stage hands downstream: its key, its content hash, the upstream hashes it was built from, figures."""

    model_config = ConfigDict(frozen=True)

    stage: str
    key: str
    hash: str
    upstream: dict[str, str] = Field(default_factory=dict)
    figures: FiguresT
    # what building it took, so that a run reusing it can say what the reuse saved; None in records made before
    # builds were timed
    compute: Compute | None = None
    # not stored: set when an existing artifact is handed back
    reused: bool = Field(default=False, exclude=True)

    @property
    def dir(self) -> Path:
        return artifact_dir(self.stage, self.key)


def everything(_: str) -> bool:
    return True


def bookkeeping(relative: str) -> bool:
    return relative in (RECORD_FILE, MANIFEST_FILE)


Builder = Callable[[Path], FiguresT]


class ArtifactStore(Protocol):
    """A store shared by every machine that runs stages: `<stage>/<key>/` holds an artifact's files."""

    def has(self, stage: str, key: str) -> bool: ...

    def download(self, stage: str, key: str, target: Path) -> bool: ...

    def upload(self, folder: Path, stage: str, key: str) -> bool: ...

    def discard(self, stage: str, key: str) -> None: ...


# set by the stage runner around a stage, so that stage modules never need to know about them
shared_store: ContextVar[ArtifactStore | None] = ContextVar("shared_store", default=None)
leader_wait: ContextVar[float] = ContextVar("leader_wait", default=LEADER_WAIT_SECONDS)


@contextmanager
def sharing(store: ArtifactStore | None, wait_seconds: float = LEADER_WAIT_SECONDS) -> Iterator[None]:
    """Use `store` (None: none) for the artifacts built, reused and needed inside this block; a machine that took
    part in a multi-node build waits `wait_seconds` for the leading machine to publish it there."""
    tokens = shared_store.set(store), leader_wait.set(wait_seconds)
    try:
        yield
    finally:
        shared_store.reset(tokens[0])
        leader_wait.reset(tokens[1])


def build_artifact(record_type: type[StageRecord], stage: str, key: str, build: Builder,
                   upstream: Iterable[StageRecord] = (), content: Callable[[str], bool] = everything,
                   resumable: bool = False, held: Compute = ONE_CPU, follower: int = 0) -> Any:
    """Return the artifact for `key`, building it first when there is no sound one here or in the shared store.

    `build(folder)` writes into a private folder and returns the figures; the content hash covers
    the files `content` selects. Builds of one key are serialized across processes: a second run
    waits, then reuses. A resumable build (training) keeps its partial folder across failures. The record keeps
    the build's wall time on the devices it `held`. A `follower` (a multi-node training's node rank above 0) takes
    part in a build another machine leads: see `follow`.
    """
    final = artifact_dir(stage, key)
    sources = {record.stage: record.hash for record in upstream}
    found = reusable(record_type, final, sources)
    if found is not None:
        return shared(final, found)

    def check(record: Any, manifest: dict[str, str]) -> str | None:
        return built_here_problem(record, manifest, stage, key, sources, content)

    if follower:
        # where the leading machine reuses the shared store's artifact (and trains nothing), so does this one; else it
        # takes part in the build and keeps the leader's artifact. Only the leader publishes: two machines pushing one
        # key at once would mix their files in the store
        found = pulled(record_type, final, check)
        return found or follow(record_type, stage, key, sources, build, content, final, held, follower, check)
    with exclusive(final.with_name(f"{key}.lock")):
        # another run may have finished this very artifact while this one waited
        found = reusable(record_type, final, sources) or pulled(record_type, final, check)
        if found is not None:
            return shared(final, found)
        work = final.with_name(f"{key}.partial" if resumable else f"{key}.tmp-{uuid.uuid4().hex[:8]}")
        return shared(final, finish(record_type, stage, key, sources, build, content, final, work, resumable, held))


def follow(record_type: type[StageRecord], stage: str, key: str, sources: dict[str, str], build: Builder,
           content: Callable[[str], bool], final: Path, held: Compute, follower: int, check: RemoteCheck) -> Any:
    """Build without the key's lock, which the leading machine holds until the build every machine takes part in is
    done (waiting for it would deadlock machines sharing a workspace), in folders of this machine's own; then keep the
    leader's artifact: in this workspace where it is shared, else from the shared store once the leader publishes it.
    This machine's own copy is not kept: it may lack what the leader alone writes (the weights, which only global
    rank 0 saves)."""
    own = final.with_name(f"{key}.node-{follower}")
    finish(record_type, stage, key, sources, build, content, own, own.with_name(f"{own.name}.partial"), True, held)
    shutil.rmtree(own, ignore_errors=True)
    with exclusive(final.with_name(f"{key}.lock")):
        found = reusable(record_type, final, sources)
    found = found or published(record_type, final, check)
    if found is None:
        advice = f"it did not come within {leader_wait.get() / 60:g} min: check that node rank 0 runs with the same " \
            "workspace.remote, or raise workspace.leader_wait_minutes" if shared_store.get() else \
            "share the workspace or set workspace.remote on every machine"
        raise MissingInputError(f"{stage} artifact {key}: this machine (node rank {follower}) took part, but the "
                                "leading machine's (node rank 0) is neither in this workspace nor in the shared store "
                                f"(workspace.remote): {advice}")
    return found


def published(record_type: type[StageRecord], final: Path, check: RemoteCheck) -> Any | None:
    """The leading machine's artifact, pulled from the shared store once it is there (it publishes it after its own
    last steps: consolidating the weights, uploading them); None without a store, or when it does not come within
    workspace.leader_wait_minutes."""
    if shared_store.get() is None:
        return None
    deadline = time.monotonic() + leader_wait.get()
    log.info("%s artifact %s: waiting for the leading machine to publish it in the shared store", final.parent.name,
             final.name)
    while True:
        found = pulled(record_type, final, check)
        if found is not None or time.monotonic() > deadline:
            return found
        time.sleep(2)


def ensure_local(record: StageRecord) -> None:
    """Bring an artifact another machine built into this workspace from the shared store, verified."""
    final = record.dir
    store = shared_store.get()
    if store is None or (final / RECORD_FILE).is_file():
        return
    with exclusive(final.with_name(f"{record.key}.lock")):
        if (final / RECORD_FILE).is_file():
            return

        def same_record(found: StageRecord, _: dict[str, str]) -> str | None:
            same = (found.stage, found.key, found.hash, found.upstream) == (record.stage, record.key, record.hash,
                                                                            record.upstream)
            return None if same else "its record differs from the one handed over"

        if pulled(type(record), final, same_record) is None:
            raise MissingInputError(f"{record.stage} artifact {record.key} is neither in {final.parent} nor, "
                                    "intact, in the shared store (workspace.remote)")


def shared(folder: Path, record: Any) -> Any:
    """Push the artifact to the shared store unless it is there already."""
    store = shared_store.get()
    if store is None or store.has(record.stage, record.key):
        return record
    if store.upload(folder, record.stage, record.key):
        log.info("%s artifact %s pushed to the shared store", record.stage, record.key)
    else:
        log.info("%s artifact %s: another machine is publishing it in the shared store", record.stage, record.key)
    return record


RemoteCheck = Callable[[Any, dict[str, str]], str | None]


def pulled(record_type: type[StageRecord], final: Path, check: RemoteCheck) -> Any | None:
    """The artifact from the shared store, downloaded into a private folder, verified, renamed into place."""
    store = shared_store.get()
    if store is None:
        return None
    stage, key = final.parent.name, final.name
    work = final.with_name(f"{key}.pull-{uuid.uuid4().hex[:8]}")
    try:
        if not store.download(stage, key, work):
            return None
        problem = downloaded_problem(record_type, work, check)
        if problem is not None:
            log.warning("%s artifact %s in the shared store is not used (%s): building it here", stage, key, problem)
            store.discard(stage, key)  # unpublished, so that the copy built here replaces it
            return None
        if final.exists():
            shutil.rmtree(final, ignore_errors=True)
        os.replace(work, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("%s artifact %s pulled from the shared store", stage, key)
    return load_record(record_type, final)


def downloaded_problem(record_type: type[StageRecord], folder: Path, check: RemoteCheck) -> str | None:
    """What is wrong with a downloaded artifact: a file that differs from its manifest, or the wrong record."""
    try:
        record = record_type.model_validate_json((folder / RECORD_FILE).read_text())
        manifest = json.loads((folder / MANIFEST_FILE).read_text())
    except (OSError, ValueError, ValidationError) as err:
        return f"unreadable record or manifest: {type(err).__name__}"
    return verify(folder) or check(record, manifest)


def built_here_problem(record: StageRecord, manifest: dict[str, str], stage: str, key: str,
                       sources: dict[str, str], content: Callable[[str], bool]) -> str | None:
    """Whether a downloaded record is the artifact this build would make: same key, same upstream bytes, and a
    content hash that is the hash of the manifest's content files."""
    if (record.stage, record.key) != (stage, key):
        return "its record names another artifact"
    if record.upstream != sources:
        return "built from other upstream artifacts"
    if record.hash != hash_json({name: digest for name, digest in manifest.items() if content(name)}):
        return "its record's content hash does not match its manifest"
    return None


def reusable(record_type: type[StageRecord], folder: Path, sources: dict[str, str]) -> Any | None:
    """The stored record, when the folder is intact and was built from the same upstream artifacts."""
    record = load_record(record_type, folder)
    if record is None:
        return None
    problem = verify(folder) or (None if record.upstream == sources else "built from other upstream artifacts")
    if problem is None:
        return record
    log.warning("%s artifact %s is not reused (%s): rebuilding it", record.stage, folder.name, problem)
    set_aside(folder)
    return None


def load_record(record_type: type[StageRecord], folder: Path) -> Any | None:
    path = folder / RECORD_FILE
    if not path.is_file():
        return None
    return record_type.model_validate_json(path.read_text()).model_copy(update={"reused": True})


def verify(folder: Path) -> str | None:
    """None when every file the manifest lists is present with its hash and nothing was added; else what differs."""
    manifest_path = folder / MANIFEST_FILE
    if not manifest_path.is_file():
        return "no manifest"
    expected = json.loads(manifest_path.read_text())
    actual = file_hashes(folder, lambda rel: not bookkeeping(rel))
    changed = sorted(name for name in expected.keys() | actual.keys() if expected.get(name) != actual.get(name))
    if changed:
        return f"{len(changed)} file(s) differ from the manifest, e.g. {changed[0]}"
    return None


def set_aside(folder: Path) -> None:
    """Move a folder that must not be reused out of the way, keeping it for a person to look at."""
    target = folder.with_name(f"{folder.name}.rejected-{uuid.uuid4().hex[:8]}")
    try:
        os.replace(folder, target)
    except OSError:
        shutil.rmtree(folder, ignore_errors=True)


def finish(record_type: type[StageRecord], stage: str, key: str, sources: dict[str, str], build: Builder,
           content: Callable[[str], bool], final: Path, work: Path, resumable: bool, held: Compute) -> Any:
    work.mkdir(parents=True, exist_ok=True)
    try:
        started = time.perf_counter()
        figures = build(work)
        hashes = file_hashes(work, lambda rel: not bookkeeping(rel))
        took = held.model_copy(update={"seconds": round(time.perf_counter() - started, 3)})
        record = record_type(stage=stage, key=key, hash=hash_json({k: v for k, v in hashes.items() if content(k)}),
                             upstream=sources, figures=figures, compute=took)
        write_text_synced(work / MANIFEST_FILE, json.dumps(hashes, indent=1, sort_keys=True))
        write_text_synced(work / RECORD_FILE, record.model_dump_json(indent=2))
    except BaseException as err:
        if not resumable:
            shutil.rmtree(work, ignore_errors=True)
        if isinstance(err, OSError) and err.errno in NO_SPACE:
            kept = "its partial folder is kept to resume from" if resumable else "nothing of it was kept"
            raise StorageFullError(f"{stage} artifact {key}: {os.strerror(err.errno)} while writing it under "
                                   f"{final.parent} ({kept}); free some space and run again") from err
        raise
    if final.exists():
        shutil.rmtree(final, ignore_errors=True)
    os.replace(work, final)
    return record
