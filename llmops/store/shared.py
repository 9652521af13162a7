"""The shared artifact store (`workspace.remote`): any fsspec URL, S3 and S3-compatible stores included.

The store mirrors the workspace's layout, `<remote>/<stage>/<key>/`. An upload sends the
manifest and the record last: a reader that finds a record finds every file before it, so an
artifact is published by its record and unpublished by removing it. One machine publishes a key:
it first creates `<stage>/<key>/.claim`, exclusively, and a machine that finds the claim taken
leaves the upload to its holder. Two machines that build the same data stage at once would
otherwise write one folder file by file, and files that are not content (a library's random ids)
would come from one machine and the manifest from the other. The claim lives in the artifact's
folder, so that removing the folder by hand removes it too and the next machine publishes again.
What a download brings is verified by the workspace, file by file, against the manifest, before it
is used.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from llmops.io.errors import Transient, UserError
from llmops.store.artifacts import MANIFEST_FILE, RECORD_FILE
from llmops.store.settings import storage_options, store_library_error, store_refusal

log = logging.getLogger("llmops.remote")
# where a stage run on another machine leaves its record for the flow that sent it there
HANDOFFS = "handoffs"
# a claim this old whose artifact was never published is taken to be a crashed upload's, and taken over
STALE_CLAIM_SECONDS = 6 * 3600.0
CLAIM_FILE = ".claim"


Method = TypeVar("Method", bound=Callable[..., Any])


class SharedStoreError(Transient, UserError):
    """workspace.remote cannot be reached: no credentials, an endpoint that does not answer, access denied."""


def said_plainly(method: Method) -> Method:
    """A store operation whose storage library's errors become one line naming the setting. The OS's errors pass
    as they are: a missing file is an answer the callers act on."""
    @functools.wraps(method)
    def run(self: FsspecStore, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as err:
            if not store_library_error(err):
                raise
            raise SharedStoreError(store_refusal("workspace.remote", self.url, err)) from err

    return run  # type: ignore[return-value]


class FsspecStore:
    """An artifact store at an fsspec URL; credentials and endpoints come from the environment."""

    def __init__(self, url: str) -> None:
        import fsspec

        self.url = url
        # a fresh client: endpoints and keys come from the environment, which a cached one would not see change
        self.fs, self.root = fsspec.core.url_to_fs(url, skip_instance_cache=True, **storage_options(url))
        self.root = self.root.rstrip("/")

    def path(self, *parts: str) -> str:
        return "/".join((self.root, *parts))

    def claim_path(self, stage: str, key: str) -> str:
        return self.path(stage, key, CLAIM_FILE)

    @said_plainly
    def has(self, stage: str, key: str) -> bool:
        self.fs.invalidate_cache()  # another machine may have published it since this process last looked
        return self.fs.exists(self.path(stage, key, RECORD_FILE))

    @said_plainly
    def download(self, stage: str, key: str, target: Path) -> bool:
        """Copy every file of a published artifact into `target`; False when it is not published."""
        if not self.has(stage, key):
            return False
        base, claim = self.path(stage, key), self.claim_path(stage, key)
        for remote in self.fs.find(base):
            if not remote.startswith(base + "/") or remote == claim:
                continue  # the claim is the store's, not the artifact's
            local = target / remote[len(base) + 1:]
            local.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(remote, str(local))
        return True

    @said_plainly
    def upload(self, folder: Path, stage: str, key: str) -> bool:
        """Send every file, then the manifest, then the record that publishes them; False when another machine
        holds the key's claim (it is publishing the artifact, or has)."""
        if not self.claim(stage, key):
            return False
        try:
            self.send(folder, stage, key)
        except BaseException:
            with contextlib.suppress(Exception):  # the upload's own error is the one to report
                self.fs.rm_file(self.claim_path(stage, key))  # so that another machine can publish it
            raise
        return True

    def send(self, folder: Path, stage: str, key: str) -> None:
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        last = [folder / MANIFEST_FILE, folder / RECORD_FILE]
        for path in [p for p in files if p not in last] + [p for p in last if p.is_file()]:
            remote = self.path(stage, key, path.relative_to(folder).as_posix())
            self.fs.makedirs(remote.rpartition("/")[0], exist_ok=True)
            self.fs.put_file(str(path), remote)

    @said_plainly
    def claim(self, stage: str, key: str) -> bool:
        """Create the key's claim, exclusively; True when this call made it. A stale claim of an artifact never
        published is removed and claimed again."""
        path = self.claim_path(stage, key)
        note = json.dumps({"host": socket.gethostname(), "at": time.time()}).encode()
        self.fs.makedirs(path.rpartition("/")[0], exist_ok=True)
        for _ in range(2):
            try:
                self.create(path, note)
                return True
            except FileExistsError:
                if not self.stale(path, stage, key):
                    return False
                log.warning("%s artifact %s: the claim in the shared store is older than %d h and nothing was "
                            "published: taking it over", stage, key, STALE_CLAIM_SECONDS // 3600)
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(path)
        return False

    def create(self, path: str, data: bytes) -> None:
        """Write a new file, raising FileExistsError when it exists: atomically where the filesystem can (a local
        file's exclusive open, S3's If-None-Match), else by looking first."""
        try:
            with self.fs.open(path, "xb") as out:
                out.write(data)
        except (ValueError, NotImplementedError):  # no exclusive mode on this filesystem
            self.fs.pipe_file(path, data, mode="create")

    def stale(self, claim: str, stage: str, key: str) -> bool:
        if self.has(stage, key):
            return False
        try:
            made = float(json.loads(self.fs.cat_file(claim))["at"])
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return True  # gone since, or unreadable: nothing to wait for
        return time.time() - made > STALE_CLAIM_SECONDS

    @said_plainly
    def discard(self, stage: str, key: str) -> None:
        """Unpublish an artifact: without its record no reader uses it; its claim goes too, so that the next
        upload replaces it."""
        for path in (self.path(stage, key, RECORD_FILE), self.claim_path(stage, key)):
            with contextlib.suppress(FileNotFoundError):  # another machine that found the copy bad came first
                self.fs.rm_file(path)

    @said_plainly
    def hand_over(self, name: str, text: str) -> None:
        """Leave a stage record for the flow waiting on this run (`name`: the run's id)."""
        path = self.path(HANDOFFS, f"{name}.json")
        self.fs.makedirs(path.rpartition("/")[0], exist_ok=True)
        self.fs.pipe_file(path, text.encode())

    @said_plainly
    def take_over(self, name: str) -> str:
        path = self.path(HANDOFFS, f"{name}.json")
        self.fs.invalidate_cache()
        if not self.fs.exists(path):
            raise FileNotFoundError(f"{self.url}: run {name} left no stage record in {HANDOFFS}/")
        text = self.fs.cat_file(path).decode()
        self.fs.rm_file(path)
        return text


def open_store(url: str | None) -> FsspecStore | None:
    return FsspecStore(url) if url else None
