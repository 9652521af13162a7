"""Standard benchmarks through lm-evaluation-harness: what fine-tuning kept of what a model could do.

`evaluate.benchmarks` names lm-eval tasks. A local task is a YAML of lm-eval's own format in a folder of
`evaluate.benchmark_paths` or among the tasks llmops ships (evaluation/tasks/); its data files are read relative to
its YAML, so a task folder moves as a whole. Any other name is one of the harness's own tasks, whose data comes from
the hub. Each task is scored on its main metric (the first its YAML lists) with the harness's standard error; the
95% interval is score ± 1.96 standard errors. The evaluate stage runs every task on the trained model and on its
starting point; the gate runs the guarded ones on the champion (registry/gate.py).
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from llmops.config.evaluation import EvaluateConfig
from llmops.config.schema import PipelineConfig
from llmops.io.errors import UserError, first_line
from llmops.io.files import hash_file, hash_json, project_root

log = logging.getLogger("llmops.benchmarks")

SHIPPED = Path(__file__).with_name("tasks")
RESULTS = "benchmarks.json"
HARNESS = "lm-eval"
Z95 = 1.96


class BenchmarkError(UserError):
    pass


def harness_version() -> str:
    """lm-eval's version, or one line on how to install it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(HARNESS)
    except PackageNotFoundError:
        raise BenchmarkError("evaluate.benchmarks runs lm-evaluation-harness, which is not installed: "
                             "pip install 'llmops[benchmarks]'") from None


def task_folders(settings: EvaluateConfig, root: Path) -> list[Path]:
    folders = [root / path for path in settings.benchmark_paths]
    for folder in folders:
        if not folder.is_dir():
            raise BenchmarkError(f"evaluate.benchmark_paths: {folder} is not a folder of lm-eval task files")
    return [*folders, SHIPPED]


def local_tasks(settings: EvaluateConfig, root: Path) -> dict[str, Path]:
    """The YAML of every named task found locally (user folders first, then the shipped ones)."""
    from lm_eval.tasks import TaskManager

    index = TaskManager(include_path=[str(folder) for folder in task_folders(settings, root)],
                        include_defaults=False).task_index
    found = {name: index[name].yaml_path for name in settings.benchmarks if name in index}
    return {name: Path(path) for name, path in found.items() if path is not None}


def localized(yaml_path: Path) -> dict[str, Any]:
    """A local task's config with its data files made absolute (relative to its YAML, not to where llmops runs)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    spec = load_yaml(yaml_path)
    kwargs = dict(spec.get("dataset_kwargs") or {})
    if "data_files" in kwargs:
        kwargs["data_files"] = absolute(kwargs["data_files"], yaml_path.parent)
        spec["dataset_kwargs"] = kwargs
    return spec


def absolute(files: Any, folder: Path) -> Any:
    if isinstance(files, str):
        return files if "://" in files or Path(files).is_absolute() else str(folder / files)
    if isinstance(files, list):
        return [absolute(item, folder) for item in files]
    if isinstance(files, dict):
        return {split: absolute(item, folder) for split, item in files.items()}
    return files


def data_files(spec: dict[str, Any]) -> list[Path]:
    files = (spec.get("dataset_kwargs") or {}).get("data_files")
    flat = files.values() if isinstance(files, dict) else [files]
    paths = [item for group in flat for item in (group if isinstance(group, list) else [group])]
    return [Path(path) for path in paths if isinstance(path, str) and "://" not in path]


def input_fingerprints(config: PipelineConfig, root: Path) -> dict[str, Any]:
    """What the benchmarks' scores depend on besides the models: each local task's files (its folder, where its YAML
    and any code it names live, and its data files), each harness task's name, and the harness's version."""
    settings = config.evaluate
    if not settings.benchmarks:
        return {}
    version, tasks = harness_version(), {}
    local = local_tasks(settings, root)
    for name in settings.benchmarks:
        if name not in local:
            tasks[name] = "lm-eval's own"
            continue
        folder = local[name].parent
        files = sorted({*(path for path in folder.iterdir() if path.is_file()), *present(data_files(localized(
            local[name])), name)})
        tasks[name] = hash_json({path.name if path.parent == folder else str(path): hash_file(path)
                                 for path in files})
    return {HARNESS: version, "tasks": tasks}


def present(paths: list[Path], task: str) -> list[Path]:
    missing = [str(path) for path in paths if not path.is_file()]
    if missing:
        raise BenchmarkError(f"benchmark {task}: its data file {missing[0]} does not exist")
    return paths


def task_specs(settings: EvaluateConfig, root: Path | None = None) -> list[str | dict[str, Any]]:
    """What the harness is handed for each task: a local task's config, else the harness's name for it."""
    harness_version()
    local = local_tasks(settings, root or project_root())
    return [localized(local[name]) if name in local else name for name in settings.benchmarks]


def run(model: Any, tokenizer: Any, specs: list[str | dict[str, Any]], settings: EvaluateConfig,
        backend: str) -> dict[str, dict[str, Any]]:
    """Each task's main metric on this model: {task: {metric, higher_is_better, score, stderr, low, high, samples}}."""
    from lm_eval import evaluator
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    # the harness bootstraps some standard errors in a forked process pool, which a process holding threads (Prefect's,
    # MLflow's) cannot fork safely: it hangs. In-process resampling it is
    os.environ["DISABLE_MULTIPROC"] = "1"
    # the harness warns that a model handed over as an object ignores its loading arguments: none are given
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    wrapped = HFLM(pretrained=model, tokenizer=tokenizer, backend=backend, device=str(model.device),
                   batch_size=settings.batch_size)
    # the harness's own task index (thousands of YAMLs) is read only when a task is not local
    manager = TaskManager(include_defaults=any(isinstance(spec, str) for spec in specs))
    try:
        results = evaluator.simple_evaluate(model=wrapped, tasks=specs, task_manager=manager,
                                            limit=settings.benchmark_limit, log_samples=False,
                                            apply_chat_template=bool(getattr(tokenizer, "chat_template", None)),
                                            bootstrap_iters=1000, verbosity="ERROR")
    except (KeyError, ValueError, OSError, ConnectionError) as err:  # an unknown name, a hub out of reach
        names = [spec if isinstance(spec, str) else spec.get("task") for spec in specs]
        raise BenchmarkError(f"benchmarks {', '.join(map(str, names))} could not run: {first_line(err)}") from None
    return {name: main_score(results, name) for name in settings.benchmarks}



def main_score(results: dict[str, Any], task: str) -> dict[str, Any]:
    """The task's first metric, its standard error and its 95% interval."""
    entry = results["results"][task]
    directions = results.get("higher_is_better", {}).get(task) or {}
    metrics = [key.partition(",")[0] for key in entry if "," in key and "_stderr" not in key]
    metric = next((name for name in directions if name in metrics), metrics[0])
    score = float(entry[next(key for key in entry if key.partition(",")[0] == metric)])
    stderr = as_float(next((entry[key] for key in entry if key.partition(",")[0] == f"{metric}_stderr"), None))
    margin = Z95 * stderr
    return {"metric": metric, "higher_is_better": bool(directions.get(metric, True)), "score": score,
            "stderr": stderr, "low": score - margin, "high": score + margin,
            "samples": int(results.get("n-samples", {}).get(task, {}).get("effective", 0))}


def as_float(value: Any) -> float:
    """A standard error; the harness writes "N/A" where it has none."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return math.nan
    return number


def write(folder: Path, scores: dict[str, dict[str, dict[str, Any]]]) -> None:
    (folder / RESULTS).write_text(json.dumps(scores, indent=2))


def drop_of(candidate: dict[str, Any], reference: dict[str, Any]) -> float:
    """How much worse the candidate scores, in the metric's units (positive when worse)."""
    worse = reference["score"] - candidate["score"]
    return worse if candidate["higher_is_better"] else -worse


def shown(score: dict[str, Any]) -> str:
    if math.isnan(score["stderr"]):  # the harness estimates no error for some aggregates (bits per byte)
        return f"{score['metric']} {score['score']:.4g} (no standard error from the harness)"
    return f"{score['metric']} {score['score']:.4g} (95% CI [{score['low']:.4g}, {score['high']:.4g}])"
