"""A registered version as the starting model: `model.name_or_path: models:/NAME@alias` (or models:/NAME/VERSION).

The reference is resolved through the registry of the tracking config, and the version is
exported once into the workspace (`registered/NAME/VERSION-HASH`), weights, tokenizer and chat
template together. The stage runner hands the stages a config whose model is that folder, so every
stage loads it as a plain model folder, and keys it by its content: when the alias moves, what
starts from it is made again; while it stays, nothing is.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from llmops.config.schema import PipelineConfig, TrackingConfig
from llmops.registry import export
from llmops.registry.references import RegistryError, is_registered, parse_reference, resolve_version
from llmops.store.settings import mask
from llmops.store.workspace import exclusive, home, safe_name
from llmops.tracking import log as tracking

READY_FILE = "config.json"


class RegisteredBaseError(RegistryError):
    """The registered model named as the base cannot be resolved: one line that says what exists instead."""


def resolve(uri: str, tracking_config: TrackingConfig) -> Any:
    """The registered version the reference names now."""
    try:
        reference = parse_reference(uri)
        where = mask(tracking.tracking_uri(tracking_config))
        return resolve_version(tracking.client(tracking_config), reference, where)
    except RegistryError as err:
        raise RegisteredBaseError(f"model.name_or_path {uri}: {err}") from None


def model_hash(version: Any) -> str:
    """The version's weights and tokenizer hash, as the register stage tags it; the version number without one."""
    return (getattr(version, "tags", None) or {}).get("model_hash") or f"version-{version.version}"


def local_folder(uri: str, tracking_config: TrackingConfig) -> Path:
    """The version as a from_pretrained folder in the workspace, exported on first use (cached by version)."""
    version = resolve(uri, tracking_config)
    name = safe_name(version.name, "registered model name")
    target = home() / "registered" / name / f"{version.version}-{model_hash(version)[:12]}"
    if (target / READY_FILE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(target.parent / f".{target.name}.lock"):
        if not (target / READY_FILE).is_file():
            shutil.rmtree(target, ignore_errors=True)
            export.export_version(f"{version.name}/{version.version}", tracking_config, target)
    return target


def resolved(config: PipelineConfig) -> PipelineConfig:
    """The config with a registered base replaced by its local folder (a folder has no revision), and so every
    registered reward model GRPO is rewarded by."""
    config = with_reward_folders(config)
    model = config.model
    if not is_registered(model.name_or_path):
        return config
    folder = str(local_folder(model.name_or_path, config.tracking))
    return config.model_copy(update={"model": model.model_copy(update={"name_or_path": folder, "revision": None})})


def with_reward_folders(config: PipelineConfig) -> PipelineConfig:
    """The config with each registered reward model (grpo.rewards[].model: models:/NAME@alias) as its local
    folder."""
    rewards = config.grpo.rewards
    if not any(is_registered(reward.model) for reward in rewards):
        return config
    folders = [reward.model_copy(update={"model": str(local_folder(reward.model, config.tracking))})
               if is_registered(reward.model) else reward for reward in rewards]
    return config.model_copy(update={"grpo": config.grpo.model_copy(update={"rewards": folders})})
