"""Alias moves: `champion` and `challenger` set by the gate or by hand, each move recorded with when and why.

Every move, by the gate (register), `llmops models promote` or `llmops models rollback`, is
appended to the registered model's history (JSON: when, alias, version, previous holder, action,
reason, by whom). `rollback` gives the champion alias back to the version that held it before the
current champion; repeated, it keeps going back.
"""

from __future__ import annotations

import getpass
import json
import logging
from datetime import UTC, datetime
from typing import Any

from llmops.core import tracking
from llmops.core.config import TrackingConfig
from llmops.registry.references import (
    CHALLENGER,
    CHAMPION,
    RegistryError,
    aliases_of,
    current_champion,
    holder,
    model_tags,
)

log = logging.getLogger("llmops.registry")

HISTORY_TAG = "alias_history"
# the history is one registered-model tag; the oldest moves give way past this many
HISTORY_LIMIT = 300


def history(mlflow_client: Any, name: str) -> list[dict[str, Any]]:
    return json.loads(model_tags(mlflow_client, name).get(HISTORY_TAG, "[]"))


def move_alias(mlflow_client: Any, name: str, alias: str, version: str, action: str, reason: str,
               by: str) -> dict[str, Any]:
    """Point the alias at the version and append the move to the registered model's history."""
    previous = holder(mlflow_client, name, alias)
    mlflow_client.set_registered_model_alias(name, alias, version)
    entry = {"at": datetime.now(UTC).isoformat(timespec="seconds"), "alias": alias, "version": str(version),
             "previous": str(previous.version) if previous is not None else None, "action": action,
             "reason": reason, "by": by}
    moves = [*history(mlflow_client, name), entry][-HISTORY_LIMIT:]
    mlflow_client.set_registered_model_tag(name, HISTORY_TAG, json.dumps(moves))
    log.info("%s of %s: version %s (%s)", alias, name, version, reason)
    return entry


def champion_line(moves: list[dict[str, Any]]) -> list[str]:
    """The versions that were champion, in order, with rolled-back ones taken off: a stack replayed from history."""
    line: list[str] = []
    for move in moves:
        if move["alias"] != CHAMPION:
            continue
        if move["action"] == "rollback":
            line = line[:-1]
        if not line or line[-1] != move["version"]:
            line.append(move["version"])
    return line


def user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown user"


def exists(mlflow_client: Any, name: str) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        mlflow_client.get_registered_model(name)
    except MlflowException:
        return False
    return True


def get_version(mlflow_client: Any, name: str, version: str | None) -> Any:
    """The version of a registered model (None: only check that the model exists)."""
    from mlflow.exceptions import MlflowException

    if not exists(mlflow_client, name):
        raise RegistryError(f"no registered model named {name!r}")
    if version is None:
        return None
    try:
        return mlflow_client.get_model_version(name, str(version))
    except MlflowException:
        raise RegistryError(f"{name} has no version {version}") from None


def promote(tracking_config: TrackingConfig, name: str, version: str, reason: str = "") -> dict[str, Any]:
    """Make a version champion by hand; it stops being challenger."""
    mlflow_client = tracking.client(tracking_config)
    found = get_version(mlflow_client, name, version)
    current = current_champion(mlflow_client, name)
    if current is not None and str(current.version) == str(found.version):
        raise RegistryError(f"{name} version {version} is already champion")
    if CHALLENGER in aliases_of(found):
        mlflow_client.delete_registered_model_alias(name, CHALLENGER)
    return move_alias(mlflow_client, name, CHAMPION, str(found.version), "promote", reason or "promoted by hand",
                      f"{user()}: llmops models promote")


def rollback(tracking_config: TrackingConfig, name: str, reason: str = "") -> dict[str, Any]:
    """Give the champion alias back to the version that held it before the current champion."""
    mlflow_client = tracking.client(tracking_config)
    current = current_champion(mlflow_client, name)
    if current is None:
        get_version(mlflow_client, name, None)
        raise RegistryError(f"{name} has no champion to roll back")
    line = champion_line(history(mlflow_client, name))
    if not line or line[-1] != str(current.version):  # moved outside llmops: the current one still counts
        line.append(str(current.version))
    if len(line) < 2:
        raise RegistryError(f"{name}: no earlier champion recorded before version {current.version}")
    why = f"rolled back from version {current.version}" + (f": {reason}" if reason else "")
    return move_alias(mlflow_client, name, CHAMPION, line[-2], "rollback", why, f"{user()}: llmops models rollback")
