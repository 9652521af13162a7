"""Dataset versions with DVC: which version a path is pinned to, and the pipeline's lock.

After a run of the default config, the stage records are written where `dvc.yaml` expects its
outputs and DVC's lock is committed, so `dvc status` is clean and `dvc repro` reuses the run.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from llmops.io.errors import MissingInputError, Transient, UserError
from llmops.io.files import project_root
from llmops.store.workspace import records_dir

log = logging.getLogger("llmops.versions")


class DataVersionError(UserError, RuntimeError):
    """The data on disk is not the version DVC pins."""

DVC_PIPELINE_CONFIG = "configs/default.yaml"


class DataVersion(BaseModel):
    dvc_file: str | None = None
    dvc_md5: str | None = None
    # False when the files on disk differ from what the .dvc file pins
    matches_dvc: bool | None = None


def find_dvc_file(data_path: Path, root: Path) -> Path | None:
    """The .dvc file that pins `data_path`: its own, or the one of a folder above it."""
    data_path = data_path.resolve()
    for candidate in (data_path, *data_path.parents):
        if candidate == root.resolve() or candidate == candidate.parent:
            break
        dvc_file = candidate.with_name(candidate.name + ".dvc")
        if dvc_file.is_file():
            return dvc_file
    return None


def data_version(data_path: Path, root: Path) -> DataVersion:
    """What pins the data, and whether the files on disk are what it pins (DVC is asked: seconds)."""
    dvc_file = find_dvc_file(data_path, root)
    if dvc_file is None:
        return DataVersion()
    return pin_of(data_path, root).model_copy(update={"matches_dvc": dvc_file_matches(dvc_file, root)})


def pin_of(data_path: Path, root: Path) -> DataVersion:
    """The .dvc file that pins the data and the md5 it pins, read from the file alone."""
    dvc_file = find_dvc_file(data_path, root)
    if dvc_file is None:
        return DataVersion()
    outs = (yaml.safe_load(dvc_file.read_text()) or {}).get("outs") or [{}]
    name = str(dvc_file.relative_to(root)) if dvc_file.is_relative_to(root) else str(dvc_file)
    return DataVersion(dvc_file=name, dvc_md5=outs[0].get("md5"))


def dvc_file_matches(dvc_file: Path, root: Path) -> bool | None:
    """Ask DVC whether the workspace holds exactly what `dvc_file` pins."""
    try:
        from dvc.repo import Repo

        with dvc_console(), Repo(str(root)) as repo:  # the answer is the project's to say, in the run's tags
            return not repo.status(targets=[str(dvc_file)])
    except Exception as err:  # a folder outside any DVC repo, or a broken one: say so, don't fail the run
        log.warning("could not ask DVC about %s: %s", dvc_file, err)
        return None


def can_commit_lock(root: Path, config_path: Path, overrides: list[str]) -> str | None:
    """Why this run's records cannot stand for dvc.yaml's stages, or None when they can."""
    if not (root / "dvc.yaml").is_file():
        return "no dvc.yaml in the project"
    if config_path.resolve() != (root / DVC_PIPELINE_CONFIG).resolve() or overrides:
        return f"dvc.yaml tracks {DVC_PIPELINE_CONFIG} without overrides"
    if not records_dir().is_relative_to(root):
        return "LLMOPS_HOME is outside the project, where dvc.yaml cannot point"
    return None


def commit_lock(root: Path) -> None:
    """Record the current deps, params and outputs of dvc.yaml's stages in dvc.lock."""
    from dvc.repo import Repo

    with dvc_console(), Repo(str(root)) as repo:  # DVC announces each lock write on its own console
        repo.commit(target=str(root / "dvc.yaml"), force=True)
    log.info("dvc.lock records this run's stages")


# the loggers DVC sets up for its console (its data and object layers warn through their own)
DVC_LOGGERS = ("dvc", "dvc_data", "dvc_objects")


@contextmanager
def dvc_console() -> Iterator[None]:
    """DVC's own console lines (its warnings too) only with --verbose: importing DVC sets its logger to INFO, whatever
    was set before, and its warnings read like the project's (a fresh clone's "missing cache files" reads like data
    loss, when the data is about to be regenerated). What matters, the project says in its own words."""
    import dvc.repo  # noqa: F401 (first: importing it sets the level)

    loggers = [logging.getLogger(name) for name in DVC_LOGGERS]
    levels = [found.level for found in loggers]
    if os.environ.get("LLMOPS_VERBOSE") != "1":
        for found in loggers:
            found.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for found, level in zip(loggers, levels, strict=True):
            found.setLevel(level)


def ensure_default_dataset() -> str:
    """Make data/ hold exactly what data.dvc pins (the example data of every shipped config): pull it, or
    regenerate it; then push it."""
    from llmops.data.synthetic import write_example_data

    root = project_root()
    if not (root / "data.dvc").is_file():
        raise MissingInputError(f"{root / 'data.dvc'} not found: run this in the project folder")
    with dvc_console():
        return pinned_and_pushed(root, write_example_data)


def pinned_and_pushed(root: Path, regenerate: Callable[[Path], Any]) -> str:
    how = "already in place"
    if pinned_data_state(root) != "matches":
        how = pull_or_regenerate(root, regenerate)
    if pinned_data_state(root) != "matches":
        raise DataVersionError("data/ does not match data.dvc: restore data/, or run `dvc add data` to pin the new "
                           "version")
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        # the bytes match the pinned md5: commit only stores them in the cache, so that push has them to send
        repo.commit(target="data.dvc", force=True)
        push_verified(repo, None, ["data.dvc"])
    return f"data/ matches data.dvc ({how}); pushed to the default DVC remote and checked there"


def pinned_data_state(root: Path) -> str:
    """'matches' when every file data.dvc pins is on disk with the pinned hash (cached or not)."""
    from dvc.repo import Repo

    outs = (yaml.safe_load((root / "data.dvc").read_text()) or {}).get("outs") or []
    if not outs or not all((root / out["path"]).exists() for out in outs):
        return "missing"
    with Repo(str(root)) as repo:
        changes = repo.status(targets=["data.dvc"]).get("data.dvc", [])
    states = {state for change in changes for state in change.get("changed outs", {}).values()}
    return "matches" if states <= {"not in cache"} else "changed"


def pull_or_regenerate(root: Path, regenerate: Callable[[Path], Any]) -> str:
    from dvc.repo import Repo

    lacked = ""
    try:
        with Repo(str(root)) as repo:
            repo.pull(targets=["data.dvc"])
        if pinned_data_state(root) == "matches":
            return "pulled from the DVC remote"
    except Exception as err:  # no remote yet, or it lacks this version: the built-in data is reproducible
        log.info("dvc pull failed: %s", err)
        lacked = explain_failed_pull(root, err)
    log.info("regenerating the example data of every shipped config")
    regenerate(root)
    return f"regenerated: {lacked}" if lacked else "regenerated"


def explain_failed_pull(root: Path, err: Exception) -> str:
    """Why a pull failed, in a few words, unless the remote is a local folder not made yet (a fresh clone, before
    its first push): a remote that exists and lacks the pinned version is worth saying, DVC's own warning is quiet."""
    from dvc.repo import Repo

    try:
        with Repo(str(root)) as repo:
            name = repo.config["core"].get("remote") or "default"
            if repo.cloud.get_remote_odb(None).fs.protocol == "local" and not Path(
                    repo.config["remote"][name]["url"]).exists():
                return ""
    except Exception:  # no remote configured, or one DVC cannot open: the pull's own error says which
        name = "default"
    from dvc.exceptions import CheckoutError

    if isinstance(err, CheckoutError):  # the pull got through and found files missing
        return f"the DVC remote '{name}' did not hold the pinned version"
    return f"could not pull from the DVC remote '{name}': {str(err).splitlines()[0].rstrip(':')}"


class PinnedData(BaseModel):
    """A dataset version DVC pins: its .dvc file and path (relative to the project) and its md5."""

    dvc_file: str
    path: str
    md5: str


def pinned(stage: Any, root: Path) -> PinnedData:
    out = stage.outs[0]
    return PinnedData(dvc_file=Path(stage.path).relative_to(root).as_posix(), path=str(out.def_path),
                      md5=str(out.hash_info.value))


def pinned_datasets(root: Path) -> list[PinnedData]:
    """Every dataset a .dvc file of the project pins (what `dvc add` wrote), in .dvc file order."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        found = [pinned(stage, root) for stage in repo.index.stages if stage.is_data_source and stage.outs]
    return sorted(found, key=lambda data: data.dvc_file)


def add_dataset(path: str) -> PinnedData:
    """Pin a new version of the data at `path` (inside the project) with DVC."""
    from dvc.repo import Repo

    root = project_root()
    target = (Path(path) if Path(path).is_absolute() else Path.cwd() / path).resolve()
    if not target.exists():
        raise MissingInputError(f"{path}: no such file or folder")
    if not target.is_relative_to(root):
        raise MissingInputError(f"{path}: outside the project ({root}); copy it in first")
    with Repo(str(root)) as repo:
        (stage,) = repo.add(str(target.relative_to(root)))
    return pinned(stage, root)


def added_message(data: PinnedData) -> str:
    """What `llmops data add` did, and what to do next."""
    return (f"{data.dvc_file} pins {data.path} at md5 {data.md5}; commit {data.dvc_file} to record the version, and "
            f"`llmops data push` to store it")


class RemoteSyncError(Transient, UserError, RuntimeError):
    """A push did not leave the remote holding the pinned data, after every retry."""


PUSH_ATTEMPTS = 4
PUSH_BACKOFF_SECONDS = 1.0


def push_dataset(remote: str | None = None) -> str:
    from dvc.repo import Repo

    with Repo(str(project_root())) as repo:
        pushed, objects = push_verified(repo, remote)
    return (f"pushed {pushed} file{'s' if pushed != 1 else ''} to the {remote or 'default'} DVC remote; "
            f"it holds all {objects} objects of the pinned data (listed and sizes compared)")


def push_verified(repo: Any, remote: str | None, targets: list[str] | None = None) -> tuple[int, int]:
    """`dvc push`, then list the remote and compare it with the local cache, object by object and size by size:
    push trusts a directory's listing file on the remote and never looks for the files it names. What is missing
    is sent again, and the whole is retried with exponential backoff. Returns (files sent, objects checked)."""
    sent, problem, attempts = 0, "", PUSH_ATTEMPTS
    for attempt in range(1, attempts + 1):
        try:
            sent += repo.push(targets=targets, remote=remote)
            missing = missing_on_remote(repo, remote, targets)
            if missing:
                sent += send_missing(repo, remote, missing)
                missing = missing_on_remote(repo, remote, targets)
            if not missing:
                return sent, len(used_objects(repo, remote, targets))
            problem = f"{len(missing)} object(s) still missing or short on the remote, e.g. {sorted(missing)[0]}"
        except Exception as err:  # any storage backend's error (S3, SSH, ...): retried, the last one reported
            problem = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        if attempt < attempts:
            delay = PUSH_BACKOFF_SECONDS * 2 ** (attempt - 1)
            log.warning("dvc push, attempt %d of %d: %s; retrying in %.0fs", attempt, attempts, problem, delay)
            time.sleep(delay)
    raise RemoteSyncError(f"dvc push to the {remote or 'default'} remote failed after {attempts} attempts: {problem}")


def used_objects(repo: Any, remote: str | None, targets: list[str] | None) -> set[str]:
    """The object ids (file and directory-listing hashes) the pinned data needs."""
    return {hash_info.value for found in repo.used_objs(targets=targets, remote=remote).values()
            for hash_info in found}


def missing_on_remote(repo: Any, remote: str | None, targets: list[str] | None) -> set[str]:
    """The needed objects the remote's listing lacks, or holds with another size than the local cache's copy."""
    local, store = repo.cache.local, repo.cloud.get_remote_odb(remote)
    by_folder: dict[str, list[str]] = {}
    for oid in used_objects(repo, remote, targets):
        by_folder.setdefault(store.fs.parent(store.oid_to_path(oid)), []).append(oid)
    missing = set()
    for folder, oids in by_folder.items():
        listed = remote_sizes(store.fs, folder)
        missing.update(oid for oid in oids if listed.get(store.fs.name(store.oid_to_path(oid)))
                       != local.fs.size(local.oid_to_path(oid)))
    return missing


def remote_sizes(fs: Any, folder: str) -> dict[str, int]:
    """File name -> size of one folder of the remote, from a fresh listing."""
    try:
        entries = fs.ls(folder, detail=True)
    except FileNotFoundError:
        return {}
    return {fs.name(entry["name"]): entry.get("size") for entry in entries if entry.get("type") != "directory"}


def send_missing(repo: Any, remote: str | None, missing: set[str]) -> int:
    """Copy objects from the local cache straight to the remote, as push would have; a short copy there is
    removed first (a transfer skips an object that exists, whatever its size)."""
    from dvc_data.hashfile.hash_info import HashInfo
    from dvc_data.hashfile.transfer import transfer

    store = repo.cloud.get_remote_odb(remote)
    for oid in missing:
        if store.fs.exists(store.oid_to_path(oid)):
            store.fs.remove(store.oid_to_path(oid))
    result = transfer(repo.cache.local, store, {HashInfo("md5", oid) for oid in missing})
    log.warning("dvc push left %d object(s) missing or short on the remote; sent them again", len(missing))
    return len(result.transferred)


def pull_dataset(remote: str | None = None) -> str:
    from dvc.repo import Repo

    with Repo(str(project_root())) as repo:
        result = repo.pull(remote=remote)
    fetched = result.get("stats", {}).get("fetched", 0)
    return f"pulled {fetched} file{'s' if fetched != 1 else ''} from the {remote or 'default'} DVC remote"
