"""Register: log the model to the MLflow run and register it as a version with its lineage.

Alias `champion` moves to the new version only when it beats the current champion on the
primary metric (the first version does); otherwise the new version becomes `challenger`.
The same weights are never registered twice: a version carrying the weights' hash is reused.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tasks import modeling, tracking, workspace
from tasks.config import PipelineConfig, RecordKind, RegisterConfig
from tasks.evaluate import EvaluateRecord
from tasks.ingest import IngestRecord
from tasks.lineage import Lineage, collect_lineage
from tasks.report import CARD, ReportRecord
from tasks.tracking import RunHandle
from tasks.train import TrainRecord

log = logging.getLogger("llmops.register")

CHAMPION, CHALLENGER = "champion", "challenger"


class Registration(BaseModel):
    """The register stage's record: which version holds the model, and under which alias."""

    model_config = ConfigDict(frozen=True, ser_json_inf_nan="constants")

    stage: str = "register"
    model_name: str
    version: str
    alias: str
    primary_metric: str
    metrics: dict[str, dict[str, float]]
    previous_champion: str | None = None
    # not stored: whether the weights were registered before
    reused: bool = Field(default=False, exclude=True)


def register(config: PipelineConfig, ingested: IngestRecord, trained: TrainRecord, evaluated: EvaluateRecord,
             described: ReportRecord, run: RunHandle) -> Registration:
    """Register the trained model with its lineage (read now: the DVC state may have changed since ingest)."""
    root = workspace.project_root()
    lineage = collect_lineage(config, ingested, run.flow_run_id, root)
    card = (described.dir / CARD).read_text() + lineage.card_section()
    # two runs of one workspace at once: the second waits, then finds the first one's version of these weights
    with tracking.registry_lock(config.registry.model_name):
        registration = register_model(config.registry, run, trained, evaluated, lineage, config.data.kind, card)
    tracking.set_tags(run.tracking, run.run_id, {
        **lineage.tags(), "registered_version": f"{registration.model_name}/{registration.version}",
        "stage.register": "reused" if registration.reused else "computed"})
    return registration


def register_model(config: RegisterConfig, run: RunHandle, trained: TrainRecord, evaluated: EvaluateRecord,
                   lineage: Lineage, kind: RecordKind, card: str = "") -> Registration:
    mlflow_client = tracking.client(run.tracking)
    metrics = evaluated.figures.metrics
    primary, higher_is_better = evaluated.figures.primary_metric, evaluated.figures.higher_is_better
    version = find_version(mlflow_client, config.model_name, trained.hash)
    reused = version is not None
    if version is None:
        tags = {**lineage.tags(), "model_hash": trained.hash, "primary_metric": primary,
                "higher_is_better": str(higher_is_better).lower(),
                **{f"metric.{model}.{name}": f"{value:.6g}" for model, values in metrics.items()
                   for name, value in values.items()}}
        version = create_version(config.model_name, log_model(run, trained.dir / "model", kind, card), tags)
        if card:
            mlflow_client.update_model_version(config.model_name, str(version.version), description=card)
    else:
        log.info("version %s of %s already holds these weights; not registering again",
                 version.version, config.model_name)
    # search results carry no aliases: read the version itself
    version = mlflow_client.get_model_version(config.model_name, str(version.version))
    champion = current_champion(mlflow_client, config.model_name)
    alias = next((a for a in (CHAMPION, CHALLENGER) if a in aliases_of(version)), None)
    if alias is None:
        # also reached when an earlier attempt registered the version but stopped before this point
        won = beats(metrics["trained"][primary], champion, primary, higher_is_better)
        alias = CHAMPION if won else CHALLENGER
        mlflow_client.set_registered_model_alias(config.model_name, alias, version.version)
    previous = str(champion.version) if champion is not None and str(champion.version) != str(version.version) \
        else None
    return Registration(model_name=config.model_name, version=str(version.version), alias=alias, reused=reused,
                        primary_metric=primary, metrics=metrics, previous_champion=previous)


def find_version(mlflow_client: Any, name: str, model_hash: str) -> Any | None:
    found = mlflow_client.search_model_versions(f"name = '{name}' and tags.model_hash = '{model_hash}'")
    return max(found, key=lambda v: int(v.version)) if found else None


def aliases_of(version: Any) -> list[str]:
    return list(getattr(version, "aliases", []) or [])


def log_model(run: RunHandle, model_dir: Path, kind: RecordKind, card: str) -> str:
    """Log weights (safetensors, or the LoRA adapter) and tokenizer with the transformers flavor; return the URI."""
    import mlflow
    from huggingface_hub import ModelCard
    from transformers import AutoTokenizer

    components = {"model": modeling.load_trained(model_dir, kind),
                  "tokenizer": AutoTokenizer.from_pretrained(str(model_dir))}
    task = "text-classification" if modeling.is_classifier(kind) else "text-generation"
    tracking.client(run.tracking)
    with mlflow.start_run(run_id=run.run_id):
        info = mlflow.transformers.log_model(components, name="model", task=task, pip_requirements=requirements(),
                                             model_card=ModelCard(card or "# Model\n"), **base_reference(model_dir))
    return info.model_uri


def base_reference(model_dir: Path) -> dict[str, str]:
    """An adapter's local base model is referenced by path, as a hub base is by id: its weights are not copied."""
    if not modeling.is_adapter(model_dir):
        return {}
    base = json.loads((model_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
    return {"base_model_path": base} if Path(base).is_dir() else {}


def requirements() -> list[str]:
    """Pinned to what trained the model, so that the versions that load it are the ones that made it."""
    import tokenizers
    import torch
    import transformers

    return [f"torch=={torch.__version__.split('+')[0]}", f"transformers=={transformers.__version__}",
            f"tokenizers=={tokenizers.__version__}", "safetensors"]


def create_version(name: str, model_uri: str, tags: dict[str, str]) -> Any:
    import mlflow

    return mlflow.register_model(model_uri, name, tags=tags)


def current_champion(mlflow_client: Any, name: str) -> Any | None:
    from mlflow.exceptions import MlflowException

    try:
        return mlflow_client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        return None


def beats(value: float, champion: Any | None, metric: str, higher_is_better: bool) -> bool:
    if champion is None:
        return True
    recorded = champion.tags.get(f"metric.trained.{metric}")
    if recorded is None:
        return True
    best = float(recorded)
    return value > best if higher_is_better else value < best


def list_versions(tracking_config: Any) -> list[dict[str, Any]]:
    """Every registered version, newest first, with aliases, metrics and lineage tags."""
    mlflow_client = tracking.client(tracking_config)
    rows = []
    for model in mlflow_client.search_registered_models():
        aliases_by_version: dict[str, list[str]] = {}
        for alias, number in (model.aliases or {}).items():
            aliases_by_version.setdefault(str(number), []).append(alias)
        for version in sorted(mlflow_client.search_model_versions(f"name = '{model.name}'"),
                              key=lambda v: int(v.version), reverse=True):
            tags = dict(version.tags)
            primary = tags.get("primary_metric", "")
            baseline = next((v for k, v in tags.items() if k.startswith("metric.") and k.endswith(f".{primary}")
                             and not k.startswith("metric.trained.")), "")
            rows.append({"name": model.name, "version": str(version.version),
                         "aliases": sorted(aliases_by_version.get(str(version.version), [])),
                         "primary_metric": primary, "trained": tags.get(f"metric.trained.{primary}", ""),
                         "baseline": baseline, "run_id": version.run_id, "tags": tags})
    return rows


def data_change(config: PipelineConfig) -> dict[str, Any]:
    """Whether the configured data differs from what the newest registered version was trained on."""
    from tasks.ingest import source_fingerprint

    current = source_fingerprint(config.data, workspace.project_root())
    mlflow_client = tracking.client(config.tracking)
    versions = mlflow_client.search_model_versions(f"name = '{config.registry.model_name}'")
    if not versions:
        return {"changed": True, "reason": "no version registered yet", "version": None, "data_sha256": current}
    newest = max(versions, key=lambda v: int(v.version))
    trained_on = newest.tags.get("data_sha256")
    reason = "new data" if trained_on != current else ""
    return {"changed": trained_on != current, "reason": reason, "version": str(newest.version),
            "data_sha256": current}
