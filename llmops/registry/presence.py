"""Whether a registered version still exists, and its aliases, asked without starting MLflow's client.

An up-to-date `llmops run` must answer in about a second; MLflow's client takes seconds to import.
A local SQLite registry is read directly (read-only), a tracking server through its REST API; any
other store cannot be asked cheaply, and the run goes ahead as usual.
"""

from __future__ import annotations

import json
import sqlite3
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from llmops.config.schema import TrackingConfig
from llmops.store.settings import registry_uri

# what a quick look may take before the run goes ahead the usual way
LOOK_SECONDS = 5.0


class Unknown(Exception):
    """The registry could not be asked cheaply: the caller takes the usual path."""


def still_registered(config: TrackingConfig, summary: dict[str, Any]) -> dict[str, Any] | None:
    """A run's summary as an unchanged run reports it: its version's aliases as the registry has them now; None when
    the run registered nothing, the version is gone (registering again is work to do) or the registry cannot be
    asked cheaply."""
    registration = summary["registration"]
    if registration.get("version") is None:
        return None
    try:
        aliases = version_aliases(config, registration["model_name"], str(registration["version"]))
    except Unknown:
        return None
    if aliases is None:  # the version was deleted: registering again is work to do
        return None
    # no cost line: this run computed nothing, and the last one's figures would read as this one's
    return {**summary, "registration": {**registration, "reused": True, "alias": ", ".join(aliases) or None,
                                         "cost": None}}


def version_aliases(config: TrackingConfig, name: str, version: str) -> list[str] | None:
    """The aliases of NAME/VERSION (possibly none), or None when the version is gone; Unknown when the registry
    cannot be asked this way."""
    uri = registry_uri(config)
    if uri.startswith("sqlite:///"):
        return from_sqlite(Path(uri.removeprefix("sqlite:///")), name, version)
    if uri.startswith(("http://", "https://")):
        return from_server(uri, name, version)
    raise Unknown(uri.partition(":")[0])


def from_sqlite(path: Path, name: str, version: str) -> list[str] | None:
    if not path.is_file():
        return None
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=LOOK_SECONDS) as db:
            found = db.execute("SELECT 1 FROM model_versions WHERE name = ? AND version = ? AND "
                               "current_stage != 'Deleted_Internal'", (name, int(version))).fetchone()
            aliases = db.execute("SELECT alias FROM registered_model_aliases WHERE name = ? AND version = ?",
                                 (name, int(version))).fetchall()
    except (sqlite3.Error, ValueError) as err:  # another schema, a locked or damaged file
        raise Unknown(str(err)) from err
    return sorted(alias for (alias,) in aliases) if found else None


def from_server(uri: str, name: str, version: str) -> list[str] | None:
    query = urllib.parse.urlencode({"name": name, "version": version})
    url = f"{uri.rstrip('/')}/api/2.0/mlflow/model-versions/get?{query}"
    try:
        with urllib.request.urlopen(url, timeout=LOOK_SECONDS) as answer:  # noqa: S310 (the configured server)
            found = json.loads(answer.read())["model_version"]
    except urllib.error.HTTPError as err:
        if err.code == 404:
            return None
        raise Unknown(f"HTTP {err.code}") from err
    except (OSError, ValueError, KeyError) as err:  # not answering, a login page, another API
        raise Unknown(str(err)) from err
    return sorted(found.get("aliases", []))
