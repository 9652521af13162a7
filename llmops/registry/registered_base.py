"""A registered version as the starting model: `model.name_or_path: models:/NAME@alias` (or models:/NAME/VERSION).

The reference is resolved through the registry of the tracking config, and the version is
exported once into the workspace (`registered/NAME/VERSION-HASH`), weights, tokenizer and chat
template together, so that every stage loads it as a plain model folder. Stage keys see the
resolved version's model hash, not the alias: when the alias moves, what starts from it is made
again; while it stays, nothing is.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from llmops.core import workspace
from llmops.core.config import ModelConfig, TrackingConfig

PREFIX = "models:/"
READY_FILE = "config.json"


class RegisteredBaseError(ValueError):
    """The registered model named as the base cannot be resolved: one line that says what exists instead."""


def is_registered(name: str | None) -> bool:
    return bool(name) and str(name).startswith(PREFIX)


def reference_of(uri: str) -> str:
    """`models:/NAME@alias` or `models:/NAME/VERSION` as the registry commands spell it (NAME@alias, NAME/VERSION)."""
    body = uri[len(PREFIX):]
    if not re.fullmatch(r"[^/@]+(@[^/@]+|/\d+)", body):
        raise RegisteredBaseError(f"model.name_or_path {uri!r}: expected models:/NAME@alias or models:/NAME/VERSION")
    return body


def resolve(uri: str, tracking_config: TrackingConfig) -> Any:
    """The registered version the reference names now."""
    from llmops.core import tracking
    from llmops.serving import predict

    reference = predict.parse_reference(reference_of(uri))
    where = predict.masked(tracking.tracking_uri(tracking_config))
    try:
        return predict.resolve_version(tracking.client(tracking_config), reference, where)
    except predict.PredictError as err:
        raise RegisteredBaseError(f"model.name_or_path {uri}: {err}") from None


def model_hash(version: Any) -> str:
    """The version's weights and tokenizer hash, as the register stage tags it; the version number without one."""
    return (getattr(version, "tags", None) or {}).get("model_hash") or f"version-{version.version}"


def fingerprint(uri: str, tracking_config: TrackingConfig) -> dict[str, Any]:
    version = resolve(uri, tracking_config)
    return {"registered": version.name, "version": str(version.version), "model_hash": model_hash(version)}


def local_folder(uri: str, tracking_config: TrackingConfig) -> Path:
    """The version as a from_pretrained folder in the workspace, exported on first use (cached by version)."""
    from llmops.registry import export

    version = resolve(uri, tracking_config)
    name = workspace.safe_name(version.name, "registered model name")
    target = workspace.home() / "registered" / name / f"{version.version}-{model_hash(version)[:12]}"
    if (target / READY_FILE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with workspace.exclusive(target.parent / f".{target.name}.lock"):
        if not (target / READY_FILE).is_file():
            shutil.rmtree(target, ignore_errors=True)
            export.export_version(f"{version.name}/{version.version}", tracking_config, target)
    return target


def local_name(name: str | None, tracking_config: TrackingConfig) -> str | None:
    """What from_pretrained loads for a configured name: the exported folder of a registered version, else the name."""
    return str(local_folder(name, tracking_config)) if is_registered(name) else name


def resolved_model(model_config: ModelConfig, tracking_config: TrackingConfig) -> ModelConfig:
    """The model section with a registered base replaced by its local folder (a folder has no revision)."""
    if not is_registered(model_config.name_or_path):
        return model_config
    return model_config.model_copy(update={"name_or_path": local_name(model_config.name_or_path, tracking_config),
                                           "revision": None})
