"""A registered version's file manifest: what its files hashed to when it was registered, checked when it is loaded.

A version that still loads can hold the wrong bytes (a flipped bit in a weight, a partial overwrite
in the artifact store, a tokenizer file swapped by hand): loading alone would serve it. So
registration downloads the version as a loader will see it, hashes each file, and tags the version
with the manifest (`files.sha256`); loading hashes what it downloaded and refuses a version whose
files differ, naming the first that does. The manifest lives in the registry's database, apart
from the artifact store whose files it vouches for. Where the names and hashes do not fit a tag, the
tag holds one hash over all of them (`tree:...`): the check still holds, it just cannot name the file.
A version registered without a manifest (by hand, or before manifests) loads unchecked.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from llmops.io.files import file_hashes, hash_json
from llmops.registry.references import RegistryError
from llmops.tracking.log import MODEL_TAG_LIMIT

MANIFEST_TAG = "files.sha256"
# a file's hash in the tag: 64 bits tell a damaged file from its original; the tag must fit the registry's column
SHORT = 16
TREE = "tree:"


def manifest_tag(folder: Path) -> str:
    """The tag's value for the files under `folder`: each file's short hash, or one hash over all where that
    does not fit."""
    hashes = file_hashes(folder)
    listed = json.dumps({name: digest[:SHORT] for name, digest in hashes.items()}, sort_keys=True,
                        separators=(",", ":"))
    return listed if len(listed) <= MODEL_TAG_LIMIT else TREE + hash_json(hashes)


def record_manifest(mlflow_client: Any, name: str, version: str) -> None:
    """Tag the registered version with the manifest of its files, downloaded as a loader downloads them."""
    import mlflow

    with tempfile.TemporaryDirectory() as folder:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}/{version}", dst_path=folder))
        mlflow_client.set_model_version_tag(name, version, MANIFEST_TAG, manifest_tag(local))


def check_manifest(label: str, tag: str | None, folder: Path) -> None:
    """Raise RegistryError when the files under `folder` are not the ones the version was registered with."""
    if not tag:
        return
    found = manifest_tag(folder)
    if found == tag:
        return
    if tag.startswith(TREE) or found.startswith(TREE):
        raise RegistryError(f"{label}: its files differ from the manifest it was registered with")
    expected, present = json.loads(tag), json.loads(found)
    missing = sorted(set(expected) - set(present))
    if missing:
        raise RegistryError(f"{label}: {missing[0]} is missing (the manifest it was registered with lists it)")
    changed = sorted(name for name in expected if present[name] != expected[name])
    if changed:
        raise RegistryError(f"{label}: {changed[0]} differs from the manifest it was registered with (sha256 "
                            f"{present[changed[0]]}…, registered {expected[changed[0]]}…)")
    extra = sorted(set(present) - set(expected))
    raise RegistryError(f"{label}: {extra[0]} is not in the manifest it was registered with")
