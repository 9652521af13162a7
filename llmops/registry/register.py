"""Register: log the model with its card and register it as a version with its lineage; the gate picks its alias.

The trained model must beat its starting point, then the current champion on the model name's
frozen evaluation set (both re-scored now), to become `champion`; see llmops/registry/gate.py. The version
carries its lineage (git commit, DVC data md5, config hash, tokenizer hash, seed, package versions,
Prefect flow run) as tags and its model card as description. The same weights are never
registered twice: a version carrying the weights' hash is reused.
"""

from __future__ import annotations

import json
import logging
import platform
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from llmops.config.schema import PipelineConfig, TrackingConfig
from llmops.data.ingest import IngestRecord, source_fingerprint
from llmops.data.lineage import Lineage, collect_lineage
from llmops.data.report import ReportRecord
from llmops.evaluation.evaluate import EvaluateRecord, samples
from llmops.io.files import project_root, read_jsonl
from llmops.objectives import selected
from llmops.objectives.base import Objective
from llmops.objectives.metrics import Scored
from llmops.pipeline.keys import library_versions
from llmops.pipeline.stages import StageContext
from llmops.registry import accounting, aliases, card, gate
from llmops.registry.flavors import log_model, serving_settings
from llmops.registry.gate import Comparison, FrozenSet, Verdict
from llmops.registry.manifest import record_manifest
from llmops.registry.references import (
    CHALLENGER,
    CHAMPION,
    aliases_of,
    current_champion,
    parse_reference,
    registry_errors,
    resolve_version,
)
from llmops.store.settings import mask
from llmops.tracking import log as tracking
from llmops.tracking.cost import CostFigures
from llmops.tracking.log import RunHandle
from llmops.training.session import TrainRecord

log = logging.getLogger("llmops.register")

PACKAGES = ("torch", "transformers", "tokenizers", "trl", "peft", "accelerate", "datasets", "mlflow", "llmops")
# tags a run started by an event carries onto its version (set by the code that handles the event)
TRIGGER_TAGS = ("trigger_event_id", "trigger_event")


class Registration(BaseModel):
    """The register stage's record: which version holds the model, under which alias, and why."""

    model_config = ConfigDict(frozen=True, ser_json_inf_nan="constants")

    stage: str = "register"
    model_name: str
    version: str
    # None: registered without an alias (it does not beat its baseline)
    alias: str | None
    primary_metric: str
    primary_reason: str = ""
    metrics: dict[str, dict[str, float]]
    intervals: dict[str, dict[str, dict[str, float]]] = Field(default_factory=dict)
    gain_over_baseline: dict[str, dict[str, float]] = Field(default_factory=dict)
    baseline: str = "untrained"
    examples: int = 0
    # model -> lm-eval task -> its main metric's score (evaluate.benchmarks)
    benchmarks: dict[str, dict[str, dict[str, Any]]] = Field(default_factory=dict)
    reason: str = ""
    # the one line the run ends with when the trained model does not beat its baseline
    message: str | None = None
    within_noise: bool = False
    comparison: Comparison | None = None
    previous_champion: str | None = None
    # what the run cost and the useful tokens it stands for (tracking/cost.py); None where a stage left no build record.
    # A figure of this run (what it computed, what it reused), left out of the published record, which must read the
    # same for every run that registers these weights (dvc.yaml's output)
    cost: CostFigures | None = Field(default=None, json_schema_extra={"per_run": True})
    # not stored: whether the weights were registered before
    reused: bool = Field(default=False, exclude=True)


def register(config: PipelineConfig, ingested: IngestRecord, trained: TrainRecord, evaluated: EvaluateRecord,
             described: ReportRecord, context: StageContext) -> Registration:
    """Register the trained model with its lineage (read now: the DVC state may have changed since ingest) and
    the run's cost (the stage runner's account of it) on the context's run."""
    run, cost = context.run, context.cost
    if run is None:
        raise ValueError("register runs inside a pipeline run: the stage runner hands it one")
    lineage = collect_lineage(config, ingested, run.flow_run_id, project_root(), run.trigger)
    # two runs of one workspace at once: the second waits, then finds the first one's version of these weights
    with tracking.registry_lock(config.registry.model_name), \
            registry_errors(f"registering {config.registry.model_name}"):
        registration = register_model(config, run, trained, evaluated, described, lineage, cost)
    registration = registration.model_copy(update={"cost": cost})
    tracking.set_tags(run.tracking, run.run_id, {
        **lineage.tags(), "registered_version": f"{registration.model_name}/{registration.version}",
        "stage.register": "reused" if registration.reused else "computed",
        "register.alias": registration.alias or "none", "register.reason": registration.reason,
        "evaluate.primary_metric": registration.primary_metric,
        "evaluate.primary_reason": registration.primary_reason})
    tracking.describe_run(run, summary_line(registration))
    return registration


def summary_line(registration: Registration) -> str:
    """The run in one line, as its description in MLflow's UI: the version and its alias, the primary metric against
    the baseline, what it cost."""
    primary, metrics = registration.primary_metric, registration.metrics
    trained, baseline = metrics.get("trained", {}).get(primary), metrics.get(registration.baseline, {}).get(primary)
    scored = (f"; {primary} {trained:.4g} vs {registration.baseline} {baseline:.4g}"
              if trained is not None and baseline is not None else "")
    spent = f"; cost: {accounting.line(registration.cost)}" if registration.cost is not None else ""
    return (f"{registration.model_name}/{registration.version} → {registration.alias or 'no alias'}{scored}"
            f"{spent}")


def register_model(config: PipelineConfig, run: RunHandle, trained: TrainRecord, evaluated: EvaluateRecord,
                   described: ReportRecord, lineage: Lineage, cost: CostFigures | None = None) -> Registration:
    mlflow_client = tracking.client(run.tracking)
    name = config.registry.model_name
    found = find_version(mlflow_client, name, trained.hash)
    # search results carry no aliases: read the version itself
    existing = mlflow_client.get_model_version(name, str(found.version)) if found is not None else None
    champion = current_champion(mlflow_client, name)
    held = next((a for a in (CHAMPION, CHALLENGER) if existing is not None and a in aliases_of(existing)), None)
    if held is not None:
        log.info("version %s of %s already holds these weights, as %s", existing.version, name, held)
        verdict = stored_verdict(existing, held)
        return registration_of(name, existing, verdict, evaluated, champion, reused=True)
    frozen = gate.frozen_set(config, mlflow_client, evaluated)
    verdict, scored = gate.judge(config, mlflow_client, trained, evaluated, frozen)
    model_card = card.model_card(config, trained, evaluated, described, lineage, verdict, run.run_id, cost)
    version = existing or create(config, run, trained, evaluated, lineage, verdict, frozen, model_card, cost)
    gate.pin(mlflow_client, name, frozen, run.run_id)
    gate.apply(mlflow_client, name, str(version.version), verdict, run.run_id)
    log_comparison(run, frozen, scored, selected(config.data))
    return registration_of(name, version, verdict, evaluated, champion, reused=existing is not None)


def registration_of(name: str, version: Any, verdict: Verdict, evaluated: EvaluateRecord, champion: Any | None,
                    reused: bool) -> Registration:
    figures = evaluated.figures
    previous = str(champion.version) if champion is not None and str(champion.version) != str(version.version) \
        else None
    return Registration(model_name=name, version=str(version.version), alias=verdict.alias, reused=reused,
                        primary_metric=figures.primary_metric, primary_reason=figures.primary_reason,
                        metrics=figures.metrics, intervals=figures.intervals, baseline=figures.baseline,
                        gain_over_baseline=figures.gain_over_baseline, examples=figures.examples,
                        benchmarks=figures.benchmarks, reason=verdict.reason, message=verdict.message,
                        within_noise=verdict.within_noise, comparison=verdict.comparison, previous_champion=previous)


def create(config: PipelineConfig, run: RunHandle, trained: TrainRecord, evaluated: EvaluateRecord,
           lineage: Lineage, verdict: Verdict, frozen: FrozenSet, model_card: str,
           cost: CostFigures | None = None) -> Any:
    """Log the model with its card, register it as a new version with its tags, and describe it with the card."""
    figures = evaluated.figures
    tags = {**lineage.tags(), **provenance_tags(config, trained.dir / "model"), "model_hash": trained.hash,
            "objective": str(config.data.objective),
            "primary_metric": figures.primary_metric, "higher_is_better": str(figures.higher_is_better).lower(),
            "decision": tracking.clip(verdict.reason, tracking.MODEL_TAG_LIMIT), "verdict": verdict_tag(verdict),
            "frozen_eval_md5": frozen.md5,
            **{f"metric.{model}.{metric}": f"{value:.6g}" for model, values in figures.metrics.items()
               for metric, value in values.items()},
            **{f"benchmark.{model}.{task}": f"{score['metric']} {score['score']:.6g} ± {score['stderr']:.3g}"
               for model, tasks in figures.benchmarks.items() for task, score in tasks.items()},
            **comparison_tags(verdict.comparison), **accounting.version_tags(cost)}
    name = config.registry.model_name
    version = create_version(name, log_model(run, trained.dir / "model", selected(config.data), model_card,
                                             serving_settings(config)), tags)
    client = tracking.client(run.tracking)
    record_manifest(client, name, str(version.version))
    client.update_model_version(name, str(version.version), description=card.description(model_card))
    return version


def verdict_tag(verdict: Verdict) -> str:
    """The gate's verdict as JSON (a tag holds 5,000 characters: without the comparison, whose figures are the
    `frozen.*` tags, and with the reason clipped, if it must; the `decision` tag holds the reason itself)."""
    text = verdict.model_dump_json()
    if len(text) <= tracking.MODEL_TAG_LIMIT:
        return text
    return verdict.model_copy(update={"comparison": None, "reason": tracking.clip(verdict.reason, 2000)}
                              ).model_dump_json()


def stored_verdict(version: Any, alias: str) -> Verdict:
    """The verdict a version was registered with, under the alias it holds now: a re-run that finds the same
    weights reports what the first run decided."""
    stored = version.tags.get("verdict")
    if stored:
        return Verdict.model_validate_json(stored).model_copy(update={"alias": alias})
    return Verdict(alias=alias, reason=version.tags.get("decision", f"already registered as {alias}"))


def comparison_tags(comparison: Comparison | None) -> dict[str, str]:
    if comparison is None:
        return {}
    return {"frozen.champion_version": comparison.champion_version,
            **{f"frozen.{side}.{metric}": f"{value:.6g}" for side in ("candidate", "champion")
               for metric, value in getattr(comparison, side).items()}}


def provenance_tags(config: PipelineConfig, model_dir: Path) -> dict[str, str]:
    """What else it takes to make these weights again: the tokenizer, the seed and the library versions."""
    from transformers import AutoTokenizer

    from llmops.text.tokenizers import tokenizer_hash

    return {"tokenizer_hash": tokenizer_hash(AutoTokenizer.from_pretrained(str(model_dir))),
            "seed": str(config.train.seed), "packages": json.dumps(package_versions(), sort_keys=True)}


def package_versions() -> dict[str, str]:
    import torch

    versions = library_versions(PACKAGES)
    versions["python"] = platform.python_version()
    versions["cuda"] = torch.version.cuda or "none (CPU build)"
    versions["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return versions


def log_comparison(run: RunHandle, frozen: FrozenSet, scored: dict[str, Scored], objective: Objective) -> None:
    """The frozen set's prompts and references beside the candidate's and the champion's answers, as a table."""
    if not scored or not scored["candidate"].outputs:
        return
    outputs = {name: result.outputs for name, result in scored.items()}
    table = samples(list(read_jsonl(frozen.path)), outputs, objective.kind)
    tracking.log_table(run, table, "registry/frozen_comparison.json")


def find_version(mlflow_client: Any, name: str, model_hash: str) -> Any | None:
    found = mlflow_client.search_model_versions(f"name = '{name}' and tags.model_hash = '{model_hash}'")
    return max(found, key=lambda v: int(v.version)) if found else None


def create_version(name: str, model_uri: str, tags: dict[str, str]) -> Any:
    """The new version. MLflow prints its own lines about it straight to standard error; they go to the log instead
    (shown with --verbose), since the run says what it registered in its own words."""
    import contextlib
    import io

    import mlflow

    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):
        version = mlflow.register_model(model_uri, name, tags=tags)
    for line in filter(None, printed.getvalue().splitlines()):
        log.debug("mlflow: %s", line)
    return version


def list_versions(tracking_config: Any) -> list[dict[str, Any]]:
    """Every registered version, newest first, with aliases, metrics and lineage tags."""
    with registry_errors("listing the registered versions"):
        return version_rows(tracking.client(tracking_config))


def version_rows(mlflow_client: Any) -> list[dict[str, Any]]:
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


def show_version(tracking_config: TrackingConfig, reference: str) -> dict[str, Any]:
    """One version's lineage, for a person: NAME@alias, NAME/version, or NAME (its champion)."""
    with registry_errors(f"reading {reference}"):
        return version_details(tracking.client(tracking_config), reference,
                               mask(tracking.tracking_uri(tracking_config)))


def version_details(mlflow_client: Any, reference: str, where: str) -> dict[str, Any]:
    found = resolve_version(mlflow_client, parse_reference(reference), where)
    version = mlflow_client.get_model_version(found.name, str(found.version))  # with its aliases
    tags = dict(version.tags)
    name = version.name
    return {
        "name": name, "version": str(version.version), "aliases": aliases_of(version), "run_id": version.run_id,
        "data_md5": tags.get("dvc_data_md5"), "data_sha256": tags.get("data_sha256"),
        "git_commit": tags.get("git_commit"), "git_dirty": tags.get("git_dirty"),
        "config_hash": tags.get("config_hash"), "tokenizer_hash": tags.get("tokenizer_hash"),
        "seed": tags.get("seed"), "packages": json.loads(tags.get("packages", "{}")),
        "prefect_flow_run_id": tags.get("prefect_flow_run_id"),
        **{tag: tags[tag] for tag in TRIGGER_TAGS if tag in tags},
        "primary_metric": tags.get("primary_metric"), "decision": tags.get("decision"),
        "frozen_eval_md5": tags.get("frozen_eval_md5"),
        "metrics": {key.removeprefix("metric."): value for key, value in tags.items() if key.startswith("metric.")},
        "frozen_comparison": {key.removeprefix("frozen."): value for key, value in tags.items()
                              if key.startswith("frozen.")},
        "cost": {key.removeprefix("cost."): value for key, value in tags.items() if key.startswith("cost.")},
        "alias_history": [move for move in aliases.history(mlflow_client, name)
                          if str(version.version) in (move.get("version"), move.get("previous"))],
        "config": resolved_config(version.run_id),
    }


def resolved_config(run_id: str) -> str | None:
    """The resolved config the version's run logged, as YAML text."""
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        return mlflow.artifacts.load_text(f"runs:/{run_id}/config/resolved.yaml")
    except (MlflowException, OSError):
        return None


def data_change(config: PipelineConfig) -> dict[str, Any]:
    """Whether the configured data differs from what the newest registered version was trained on."""
    current = source_fingerprint(config.data, project_root())
    mlflow_client = tracking.client(config.tracking)
    versions = mlflow_client.search_model_versions(f"name = '{config.registry.model_name}'")
    if not versions:
        return {"changed": True, "reason": "no version registered yet", "version": None, "data_sha256": current}
    newest = max(versions, key=lambda v: int(v.version))
    trained_on = newest.tags.get("data_sha256")
    reason = "new data" if trained_on != current else ""
    return {"changed": trained_on != current, "reason": reason, "version": str(newest.version),
            "data_sha256": current}
