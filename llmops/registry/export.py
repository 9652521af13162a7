"""Export: a registered version as a folder `from_pretrained` loads, and optionally onto the Hugging Face Hub.

The folder holds safetensors weights (a LoRA version's adapter merged into its base), the tokenizer
with its chat template, and the version's model card as README.md with Hub metadata. It is written
to a temporary folder and renamed into place, so a half-written export never looks complete.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from llmops.config.schema import TrackingConfig
from llmops.io.errors import UserError
from llmops.registry.loading import LoadedVersion, load_version
from llmops.registry.references import parse_reference
from llmops.tracking import log as tracking


class ExportError(UserError, ValueError):
    """The export cannot be written or pushed: one line a person can act on."""


def export_version(reference: str, tracking_config: TrackingConfig, target: Path) -> dict[str, Any]:
    """Write the version to `target` (a new or empty folder); say what was written."""
    if target.exists() and any(target.iterdir()):
        raise ExportError(f"{target} is not empty: export into a new folder")
    loaded = load_version(parse_reference(reference), tracking_config)
    model = loaded.served.model
    merged = hasattr(model, "merge_and_unload")
    if merged:
        model = model.merge_and_unload()
    scratch = target.with_name(f".{target.name}.export-{uuid.uuid4().hex[:8]}")
    scratch.mkdir(parents=True)
    try:
        model.save_pretrained(str(scratch), safe_serialization=True)
        loaded.served.tokenizer.save_pretrained(str(scratch))
        (scratch / "README.md").write_text(model_card(loaded, tracking_config), encoding="utf-8")
        if target.exists():
            target.rmdir()
        os.replace(scratch, target)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return {"name": loaded.name, "version": loaded.version, "folder": str(target), "merged_adapter": merged,
            "files": sorted(p.name for p in target.iterdir())}


def model_card(loaded: LoadedVersion, tracking_config: TrackingConfig) -> str:
    """The version's card (its description) behind the metadata the Hub reads: the registered task is the Hub's
    pipeline tag."""
    version = tracking.client(tracking_config).get_model_version(loaded.name, loaded.version)
    task = loaded.task or loaded.objective.task
    header = (f"---\nlibrary_name: transformers\npipeline_tag: {task}\ntags:\n- llmops\n"
              f"- {loaded.name}\n---\n\n")
    body = version.description or f"# {loaded.name} version {loaded.version}\n"
    return header + body + f"\n\nExported from the registry: `{loaded.name}` version {loaded.version}.\n"


def push_to_hub(folder: Path, repo: str) -> str:
    """Upload the exported folder to a Hub repository (created if needed); one line when that cannot be done."""
    from huggingface_hub import HfApi

    try:
        api = HfApi()
        api.create_repo(repo, exist_ok=True)
        commit = api.upload_folder(folder_path=str(folder), repo_id=repo,
                                   commit_message="Upload a model exported by llmops")
    except Exception as err:  # offline, no token, no permission: the Hub client raises many kinds
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ExportError(f"could not push {folder} to the Hub repository {repo}: {first}") from None
    return str(getattr(commit, "commit_url", repo))
