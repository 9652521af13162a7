"""Loading a registered version: its weights, tokenizer, task, the objective it was trained for and its run's config.

A version is found by its reference (registry/references.py) and downloaded through the registry.
Its run's resolved config says how it was trained and scored (the record kind and objective, the
label set, the lengths), so that it is asked the way its evaluation asked it.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmops.config.schema import DataConfig, EvaluateConfig, TokenizeConfig, TrackingConfig
from llmops.io.errors import ConfigError
from llmops.models import modeling
from llmops.objectives import registry
from llmops.objectives.base import Encoding, Objective, Served
from llmops.registry.manifest import MANIFEST_TAG, check_manifest
from llmops.registry.references import Reference, RegistryError, resolve_version
from llmops.store.settings import mask
from llmops.tracking import log as tracking

# what a run records about itself, read back to predict the way evaluation did
RESOLVED_CONFIG = "config/resolved.yaml"


@dataclass
class LoadedVersion:
    """A registered version, loaded and placed, with how its run encoded and generated."""

    name: str
    version: str
    objective: Objective
    # the MLflow pipeline task it was registered with (text-generation, token-classification, fill-mask, ...)
    task: str
    served: Served

    @property
    def device(self) -> str:
        return str(self.served.model.device)


def run_config(mlflow_client: Any, run_id: str | None) -> dict[str, Any]:
    """The resolved pipeline config of the run that registered the version; {} when there is none."""
    if not run_id:
        return {}
    import yaml
    from mlflow.exceptions import MlflowException

    with tempfile.TemporaryDirectory() as folder:
        try:
            path = mlflow_client.download_artifacts(run_id, RESOLVED_CONFIG, folder)
        except (MlflowException, OSError):
            return {}
        return yaml.safe_load(Path(path).read_text()) or {}


def load_version(reference: Reference, tracking_config: TrackingConfig) -> LoadedVersion:
    """Resolve the reference in the registry, load the version's weights and tokenizer, and place them."""
    from mlflow.exceptions import MlflowException

    mlflow_client = tracking.client(tracking_config)
    version = resolve_version(mlflow_client, reference, mask(tracking.tracking_uri(tracking_config)))
    settings = run_config(mlflow_client, version.run_id)
    labels = (settings.get("data") or {}).get("labels") or []
    uri = f"models:/{version.name}/{version.version}"
    try:
        with tempfile.TemporaryDirectory() as folder:
            objective, model, tokenizer, task = load_components(uri, Path(folder), settings,
                                                                version.tags.get(MANIFEST_TAG))
    except (OSError, MlflowException) as err:  # e.g. a LoRA version whose base model folder has moved
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise RegistryError(f"{reference} ({uri}) cannot be loaded: {first_line}") from None
    labelled = objective.kind.labelled
    if labelled and modeling.base_of(model).config.pad_token_id is None:
        modeling.base_of(model).config.pad_token_id = tokenizer.pad_token_id  # classifiers find a row's end by it
    tokenize, evaluate = settings.get("tokenize") or {}, settings.get("evaluate") or {}
    encoding = Encoding(int(tokenize.get("max_length") or TokenizeConfig().max_length), tuple(labels),
                        int(tokenize.get("stride") or TokenizeConfig().stride))
    served = Served(model=modeling.place(model).eval(), tokenizer=tokenizer,
                    labels=class_labels(model) if labelled else None, encoding=encoding,
                    max_new_tokens=int(evaluate.get("max_new_tokens") or EvaluateConfig().max_new_tokens))
    return LoadedVersion(name=version.name, version=str(version.version), objective=objective, task=task,
                         served=served)


def objective_of(settings: dict[str, Any], task: str) -> Objective:
    """The objective the version's run selected; for a version without a readable run config, the one registered
    as its task."""
    data = settings.get("data") or {}
    try:
        return registry.selected(DataConfig(kind=data.get("kind") or "instruction", objective=data.get("objective"),
                                            labels=data.get("labels") or []))
    except (ConfigError, ValueError):
        found = registry.by_task(task)
        if found is None:
            raise RegistryError(f"the version was registered as {task or 'an unknown task'}, which no objective "
                                "answers") from None
        return found


def class_labels(model: Any) -> list[str]:
    id2label = modeling.base_of(model).config.id2label
    return [str(id2label[index]) for index in sorted(id2label, key=int)]


def load_components(uri: str, folder: Path, settings: dict[str, Any],
                    manifest: str | None = None) -> tuple[Objective, Any, Any, str]:
    """The objective, weights, tokenizer and pipeline task of a registered version, downloaded through the registry:
    a version of MLflow's transformers flavor, or a pyfunc of this project's code (registry/flavors.py).

    MLflow rebuilds a LoRA version on its base model, but builds a classifier's base with a default
    two-label head, which the adapter's head does not fit: those load with the run's label set. A version
    registered with a file manifest loads only if its downloaded files match it (registry/manifest.py).
    """
    import mlflow
    import yaml

    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(folder)))
    check_manifest(uri.removeprefix("models:/"), manifest, local)
    flavors = yaml.safe_load((local / "MLmodel").read_text()).get("flavors") or {}
    flavor = flavors.get("transformers")
    if flavor is None:
        return project_pyfunc(uri, local, flavors.get("python_function") or {}, settings)
    task = flavor.get("task", "")
    objective = objective_of(settings, task)
    labels = (settings.get("data") or {}).get("labels") or []
    if flavor.get("peft_adaptor") and objective.kind.labelled:
        if not labels:
            raise RegistryError("this LoRA classifier's run records no label set (data.labels): its head cannot be "
                                "rebuilt")
        model = objective.load_adapter(local / flavor["peft_adaptor"], labels)
        return objective, model, tokenizer_of(local / "components" / "tokenizer"), task
    components = mlflow.transformers.load_model(str(local), return_type="components")
    return objective, components["model"], components["tokenizer"], task


def project_pyfunc(uri: str, local: Path, flavor: dict[str, Any],
                   settings: dict[str, Any]) -> tuple[Objective, Any, Any, str]:
    """A version logged as a pyfunc of this project: its model folder is an artifact, its settings its config."""
    found = (flavor.get("artifacts") or {}).get("model")
    served = flavor.get("config") or {}
    if not found or "objective" not in served:
        raise RegistryError(f"{uri} is neither a transformers model nor a model of this project; predict loads the "
                            "versions the pipeline registers")
    folder = local / found["path"]
    data = {**(settings.get("data") or {}), "kind": served["kind"], "objective": served["objective"]}
    objective = objective_of({**settings, "data": data}, served.get("task", ""))
    return objective, objective.load_trained(folder), tokenizer_of(folder), served.get("task", "")


def tokenizer_of(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))
