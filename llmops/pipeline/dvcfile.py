"""dvc.yaml, generated from the stage table for the config DVC tracks (`llmops dvc-yaml` writes it).

Each stage depends on the records of its upstream stages, on the code its key covers (its module,
every project module that module imports, and the modules of the objective the config selects), on
the files it reads from outside the workspace, and on the config fields
it reads. The fields are read from the resolved config (`.llmops/records/params.yaml`, written by
the `config` stage), so that a field left at its default is tracked as well as one set in YAML.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from llmops.config.schema import PLACEMENT, PipelineConfig, is_placement
from llmops.pipeline.keys import code_files, lookup
from llmops.pipeline.runner import PARAMS_FILE, resolve
from llmops.pipeline.stages import OBJECTIVE_CODE, STAGES, WHOLE_CONFIG, Stage

RECORDS = ".llmops/records"
HEADER = """\
# Generated from the stage table (llmops/pipeline/stages.py) by `llmops dvc-yaml`; a test fails when it drifts.
# The pipeline's stages as DVC stages, for {config}. `dvc repro` runs them one by one without Prefect;
# each reads the records of the stages before it from {records} and reuses the same content-addressed
# artifacts as the flow. A flow run of this config writes dvc.lock.
"""


def render_dvc_yaml(config: PipelineConfig, config_path: str, root: Path) -> str:
    """dvc.yaml for `config`, read from `config_path` (relative to the project `root`)."""
    stages = {"config": config_stage(config_path, root)}
    stages.update({spec.name: dvc_stage(spec, config, root) for spec in STAGES})
    body = yaml.safe_dump({"stages": stages}, sort_keys=False, width=120)
    return HEADER.format(config=config_path, records=RECORDS) + body


def config_stage(config_path: str, root: Path) -> dict[str, Any]:
    """The resolved config, defaults included: the params file every other stage reads its fields from."""
    return {
        "cmd": f"llmops config {config_path} --output {RECORDS}/{PARAMS_FILE}",
        "deps": [config_path, *module_paths(("llmops.objectives.config",), root)],
        "outs": [{f"{RECORDS}/{PARAMS_FILE}": {"cache": False}}],
    }


def dvc_stage(spec: Stage, config: PipelineConfig, root: Path) -> dict[str, Any]:
    deps = [f"{RECORDS}/{up}.json" for up in spec.upstream]
    modules = (spec.module, *resolve(OBJECTIVE_CODE)(config.data, spec.objective_code))
    deps += input_paths(spec, config, root) + module_paths(modules, root)
    return {
        "cmd": f"llmops stage {spec.name}",
        "deps": deps,
        "params": [{f"{RECORDS}/{PARAMS_FILE}": param_keys(spec)}],
        "outs": [{f"{RECORDS}/{spec.name}.json": {"cache": False}}],
    }


def param_keys(spec: Stage) -> list[str]:
    reads = [*spec.reads, *spec.gate_reads]
    if WHOLE_CONFIG in reads:
        return recipe_keys(PipelineConfig, "")
    return reads


def recipe_keys(model: type[BaseModel], prefix: str) -> list[str]:
    """Every section of the config, or a section's fields where some of them are placement fields."""
    keys = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{field.alias or name}"
        if is_placement(path):
            continue
        annotation = field.annotation
        nested = isinstance(annotation, type) and issubclass(annotation, BaseModel)
        if nested and any(p.startswith(path + ".") for p in PLACEMENT):
            keys += recipe_keys(annotation, path + ".")
        else:
            keys.append(path)
    return keys


def module_paths(modules: tuple[str, ...], root: Path) -> list[str]:
    return [path.relative_to(root).as_posix() for path in code_files(*modules)]


def input_paths(spec: Stage, config: PipelineConfig, root: Path) -> list[str]:
    """Files of the project the stage reads, as the tracked config names them: every source's path, and a
    tokenizer, base model or template path that exists (anything else is a hub id, or outside the project)."""
    names: list[str] = []
    for field in spec.input_fields:
        value = lookup(config, field)
        if isinstance(value, list):  # data sources, or folders (benchmark tasks)
            names += [item if isinstance(item, str) else item.path for item in value
                      if isinstance(item, str) or item.path]
        elif value and (root / value).exists():
            names.append(value)
    return [name for name in names if not Path(name).is_absolute()]
