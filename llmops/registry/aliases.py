"""Alias moves: `champion` and `challenger` set by the gate or by hand, each move recorded with when and why.

Every move, by the gate (register), `llmops models promote` or `llmops models rollback`, is
recorded on the registered model as a tag of its own, `alias_move.<number>.<random>`, holding the
move as JSON (when, alias, version, previous holder, action, reason, by whom). One tag per move,
because a registry's database bounds the length of a tag (5,000 characters in MLflow's schema),
never how many a model has; and two moves made at once each write their own tag, where one list
rewritten by both would lose one. The history is the moves in the order of their keys, after
those of the `alias_history` tag that held the whole list before (read, never written).
`rollback` gives the champion alias back to the version that held it before the current champion;
repeated, it keeps going back.
"""

from __future__ import annotations

import getpass
import json
import logging
import re
import secrets
from datetime import UTC, datetime
from typing import Any

from llmops.config.schema import TrackingConfig
from llmops.registry.references import (
    CHALLENGER,
    CHAMPION,
    NOT_FOUND,
    RegistryError,
    aliases_of,
    current_champion,
    holder,
    model_tags,
    registry_errors,
)
from llmops.tracking import log as tracking
from llmops.tracking.log import after_insert_race, clip

log = logging.getLogger("llmops.registry")

# before: every move in this one tag, a JSON list that outgrew the column after about 30 moves; still read
HISTORY_TAG = "alias_history"
# a move's own tag: its number (zero-padded, so that keys sort in order), then a random part, so that two moves
# that got the same number at once both stay
MOVE_PREFIX = "alias_move."
MOVE_KEY = re.compile(r"alias_move\.(\d+)\.[0-9a-f]+")
# the newest moves kept as tags; older ones give way
HISTORY_LIMIT = 300
# a move's reason and author as stored (a version's `decision` tag keeps the gate's reason, to 5,000): with the rest
# of the move they stay within MOVE_BYTES, under the 5,000 characters of the column even where it counts bytes
REASON_LIMIT, BY_LIMIT = 1000, 100
MOVE_BYTES = 4500


def history(mlflow_client: Any, name: str) -> list[dict[str, Any]]:
    """Every recorded move, oldest first: those of the old single tag, then one per tag in key order."""
    tags = model_tags(mlflow_client, name)
    return [*legacy_moves(tags), *(parsed(tags[key], key) for key in move_keys(tags))]


def legacy_moves(tags: dict[str, str]) -> list[dict[str, Any]]:
    """The moves recorded before each move had a tag of its own."""
    moves = parsed(tags.get(HISTORY_TAG, "[]"), HISTORY_TAG)
    return moves if isinstance(moves, list) else []


def move_keys(tags: dict[str, str]) -> list[str]:
    """The tags holding one move each, oldest first (unreadable ones left out)."""
    return sorted(key for key, value in tags.items()
                  if MOVE_KEY.fullmatch(key) and isinstance(parsed(value, key), dict))


def parsed(value: str, key: str) -> Any:
    """A tag's JSON; None, with a warning, when someone wrote something else into it: the rest still reads."""
    try:
        return json.loads(value)
    except ValueError:
        log.warning("tag %s is not JSON: left out of the alias history", key)
        return None


def move_alias(mlflow_client: Any, name: str, alias: str, version: str, action: str, reason: str,
               by: str) -> dict[str, Any]:
    """Point the alias at the version and record the move, as a tag of its own, in the registered model's history."""
    with registry_errors(f"moving {alias} of {name} to version {version}"):
        previous = holder(mlflow_client, name, alias)
        # two moves of a new alias at once race on its insert
        after_insert_race(lambda: mlflow_client.set_registered_model_alias(name, alias, version))
        entry = fitted({"at": datetime.now(UTC).isoformat(timespec="seconds"), "alias": alias,
                        "version": str(version), "previous": str(previous.version) if previous is not None else None,
                        "action": action, "reason": clip(reason, REASON_LIMIT), "by": clip(by, BY_LIMIT)})
        record(mlflow_client, name, entry)
    log.info("%s of %s: version %s (%s)", alias, name, version, reason)
    return entry


def fitted(entry: dict[str, Any]) -> dict[str, Any]:
    """The move with its reason cut until its JSON fits MOVE_BYTES (escaped control characters and wide characters
    can make the JSON of a clipped reason longer than its characters)."""
    while len(stored(entry).encode()) > MOVE_BYTES and entry["reason"]:
        entry = {**entry, "reason": clip(entry["reason"], len(entry["reason"]) // 2)}
    return entry


def stored(entry: dict[str, Any]) -> str:
    return json.dumps(entry, ensure_ascii=False)


def record(mlflow_client: Any, name: str, entry: dict[str, Any]) -> None:
    """Write the move as a new tag numbered after the newest move seen, then let the oldest past the limit go."""
    tags = model_tags(mlflow_client, name)
    keys = move_keys(tags)
    number = int(MOVE_KEY.fullmatch(keys[-1]).group(1)) + 1 if keys else len(legacy_moves(tags)) + 1
    key = f"{MOVE_PREFIX}{number:09d}.{secrets.token_hex(4)}"
    mlflow_client.set_registered_model_tag(name, key, stored(entry))
    for old in [*keys, key][:-HISTORY_LIMIT]:
        mlflow_client.delete_registered_model_tag(name, old)  # a tag already gone is no error


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
    except MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST":  # a registry that fails is not one without the model
            raise
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
    except MlflowException as err:
        if err.error_code not in NOT_FOUND:  # a registry that fails is not one without the version
            raise
        raise RegistryError(f"{name} has no version {version}") from None


def promote(tracking_config: TrackingConfig, name: str, version: str, reason: str = "") -> dict[str, Any]:
    """Make a version champion by hand; it stops being challenger."""
    with registry_errors(f"promoting {name} version {version}"):
        mlflow_client = tracking.client(tracking_config)
        found = get_version(mlflow_client, name, version)
        current = current_champion(mlflow_client, name)
        if current is not None and str(current.version) == str(found.version):
            raise RegistryError(f"{name} version {version} is already champion")
        if CHALLENGER in aliases_of(found):
            mlflow_client.delete_registered_model_alias(name, CHALLENGER)
        return move_alias(mlflow_client, name, CHAMPION, str(found.version), "promote",
                          reason or "promoted by hand", f"{user()}: llmops models promote")


def rollback(tracking_config: TrackingConfig, name: str, reason: str = "") -> dict[str, Any]:
    """Give the champion alias back to the version that held it before the current champion."""
    with registry_errors(f"rolling back the champion of {name}"):
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
        return move_alias(mlflow_client, name, CHAMPION, line[-2], "rollback", why,
                          f"{user()}: llmops models rollback")
