"""`llmops evaluate NAME --benchmark TASK`: lm-eval tasks on a registered version, outside a pipeline run."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from llmops.cli.environment import configure_environment
from llmops.cli.io import console
from llmops.cli.pipeline import DEFAULT_CONFIG, ConfigOpt
from llmops.cli.render import with_interval
from llmops.objectives import load_config


def evaluate(reference: Annotated[str, typer.Argument(help="NAME (its champion), NAME@alias or NAME/version.")],
             benchmark: Annotated[list[str], typer.Option(
                 "--benchmark", "-b", help="An lm-eval task: a local one (--tasks, or shipped) or the harness's own; "
                                           "repeat for several.")],
             tasks: Annotated[list[str] | None, typer.Option(
                 "--tasks", help="A folder of local lm-eval task YAMLs (adds to evaluate.benchmark_paths).")] = None,
             limit: Annotated[int | None, typer.Option("--limit", min=1, help="The first N documents of each "
                                                                            "task.")] = None,
             config: ConfigOpt = DEFAULT_CONFIG,
             as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """Run lm-evaluation-harness tasks on a registered version: each task's main metric with its 95% interval."""
    configure_environment()
    from llmops.registry.benchmarked import benchmark_reference

    loaded = load_config(config)
    settings = loaded.evaluate.model_copy(update={
        "benchmark_paths": [*loaded.evaluate.benchmark_paths, *(tasks or [])],
        "benchmark_limit": limit or loaded.evaluate.benchmark_limit})
    result = benchmark_reference(loaded.model_copy(update={"evaluate": settings}), reference, list(benchmark))
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    table = Table(title=f"{result['model']}: lm-eval benchmarks (95% intervals)")
    for column in ("task", "metric", "score", "documents"):
        table.add_column(column, justify="left" if column in ("task", "metric") else "right")
    for task, score in result["scores"].items():
        table.add_row(task, score["metric"], with_interval(score["score"], score), str(score["samples"]))
    console.print(table)
