"""How a version is logged to MLflow, so that MLflow's own clients (pyfunc, `mlflow models serve`) answer as
`llmops predict` does.

Where transformers still builds the objective's pipeline by its task, the version is logged with
MLflow's transformers flavor and the settings its evaluation used: a chat or instruction model as
`llm/v1/chat` (OpenAI-style messages in, a chat completion out, through the model's own chat
template, replies of the run's `evaluate.max_new_tokens`, greedy), a tagger aggregating on first
sub-tokens, a classifier and a masked LM as their pipelines. Where it no longer does (seq2seq,
extractive QA), the version is a pyfunc model of this project's own code (registry/pyfunc_model.py,
logged from code with the package beside it: no pickle), whose predictions are the objective's
answers. Either way the weights, tokenizer and task are in the version, and registry/loading.py
reads both back.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from llmops.config.schema import PipelineConfig
from llmops.models import modeling
from llmops.objectives.base import Objective
from llmops.tracking import log as tracking
from llmops.tracking.log import RunHandle

ARTIFACT = "model"
# the package the pyfunc model runs, copied beside it into the version
PACKAGE = Path(__file__).resolve().parents[1]
PYFUNC_MODEL = Path(__file__).with_name("pyfunc_model.py")


@dataclass(frozen=True)
class ServingSettings:
    """What a version needs to answer as its evaluation did: the run's lengths, windows, label set."""

    objective: str
    kind: str
    max_length: int
    stride: int
    max_new_tokens: int
    labels: tuple[str, ...] = ()


def serving_settings(config: PipelineConfig) -> ServingSettings:
    return ServingSettings(objective=str(config.data.objective), kind=config.data.kind,
                           max_length=config.tokenize.max_length, stride=config.tokenize.stride,
                           max_new_tokens=config.evaluate.max_new_tokens, labels=tuple(config.data.labels))


def log_model(run: RunHandle, model_dir: Path, objective: Objective, card: str,
              settings: ServingSettings | None = None) -> str:
    """Log the version as MLflow serves it best (see the module docstring); return the model's URI."""
    import mlflow
    from transformers import AutoTokenizer

    settings = settings or ServingSettings(objective.name, objective.kind.name, 256, 64, 32)
    tracking.client(run.tracking)
    with mlflow.start_run(run_id=run.run_id):
        if objective.pipeline_served:
            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
            logged = objective.loggable(objective.load_trained(model_dir), tokenizer)
            info = mlflow.transformers.log_model(logged, name=ARTIFACT, pip_requirements=requirements(),
                                                 model_card=model_card(card), **base_reference(model_dir),
                                                 **objective.flavor_settings(settings.max_new_tokens))
        else:
            info = log_pyfunc(model_dir, objective, settings, card)
    return info.model_uri


def log_pyfunc(model_dir: Path, objective: Objective, settings: ServingSettings, card: str) -> Any:
    """The version as a pyfunc of this project's code: the model folder as an artifact, the package beside it, the
    model's card and settings in its config; logged from code, so nothing is pickled."""
    import tempfile

    import mlflow

    with tempfile.TemporaryDirectory() as scratch:
        (Path(scratch) / "README.md").write_text(card or "# Model\n", encoding="utf-8")
        return mlflow.pyfunc.log_model(name=ARTIFACT, python_model=str(PYFUNC_MODEL),
                                       artifacts={ARTIFACT: str(model_dir), "card": str(Path(scratch) / "README.md")},
                                       code_paths=[str(PACKAGE)], pip_requirements=requirements(),
                                       model_config={**asdict(settings), "labels": list(settings.labels),
                                                     "task": objective.task},
                                       input_example=[objective.request_example()])


def model_card(card: str) -> Any:
    from huggingface_hub import ModelCard

    return ModelCard(card or "# Model\n")


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
            f"tokenizers=={tokenizers.__version__}", "safetensors", "numpy", "pandas", "pydantic", "pyyaml"]
