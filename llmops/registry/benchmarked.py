"""lm-eval tasks run on a registered version, loaded through the registry: the champion at the gate, and any
version by `llmops evaluate NAME --benchmark TASK`."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from llmops.config.schema import PipelineConfig
from llmops.evaluation import benchmarks
from llmops.models import modeling
from llmops.registry.loading import load_components
from llmops.registry.references import RegistryError, parse_reference, registry_errors, resolve_version
from llmops.tracking import log as tracking


def benchmark_version(config: PipelineConfig, model_uri: str, tasks: list[str]) -> dict[str, dict[str, Any]]:
    """Each task's main metric on the version at `model_uri` (config.evaluate says where local tasks are)."""
    from mlflow.exceptions import MlflowException

    settings = config.evaluate.model_copy(update={"benchmarks": tasks})
    specs, data = benchmarks.task_specs(settings), {"data": config.data.model_dump()}
    try:
        with tempfile.TemporaryDirectory() as folder:
            objective, model, tokenizer, _ = load_components(model_uri, Path(folder), data)
            if objective.benchmark_backend is None:
                raise RegistryError(f"{model_uri} is a {objective.name} model: lm-eval's tasks ask language models")
            return benchmarks.run(modeling.place(model).eval(), tokenizer, specs, settings, objective.benchmark_backend)
    except (MlflowException, OSError) as err:
        raise RegistryError(f"cannot load {model_uri} to run its benchmarks: {err}") from None


def benchmark_reference(config: PipelineConfig, reference: str, tasks: list[str]) -> dict[str, Any]:
    """The tasks on `NAME`, `NAME@alias` or `NAME/N`: which version answered, and its scores."""
    parsed = parse_reference(reference)
    mlflow_client = tracking.client(config.tracking)
    with registry_errors(f"looking up {parsed}"):
        version = resolve_version(mlflow_client, parsed, tracking.tracking_uri(config.tracking))
    uri = f"models:/{parsed.name}/{version.version}"
    return {"model": f"{parsed.name}/{version.version}", "scores": benchmark_version(config, uri, tasks)}
