"""`llmops sweep`: search config fields with an Optuna study, each trial a pipeline run; the best is registered."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from llmops.cli.environment import configure_environment
from llmops.cli.io import console, fail, show_progress
from llmops.cli.pipeline import (
    DEFAULT_CONFIG,
    ConfigArg,
    Overrides,
    Verbose,
    check_launch,
    check_registered_base,
    terminate_as_interrupt,
)
from llmops.io.errors import ConfigError, Interrupted
from llmops.store.settings import mask
from llmops.tracking import log as tracking

SpaceOpt = Annotated[str, typer.Option("--space", "-s", help="The search space (YAML): config fields and their "
                                                             "distributions.")]


def sweep(config: ConfigArg = DEFAULT_CONFIG, overrides: Overrides = None, space: SpaceOpt = "",
          trials: Annotated[int, typer.Option("--trials", "-n", min=1, help="Finished trials (completed or "
                                                                             "pruned) the study should hold.")] = 20,
          parallel: Annotated[int, typer.Option("--parallel", "-p", min=1, help="Trials at once.")] = 1,
          storage: Annotated[str | None, typer.Option("--storage", help="The study's SQL database (default: beside "
                                                                        "the MLflow store's).")] = None,
          study: Annotated[str | None, typer.Option("--study", help="The study's name (default: from the config "
                                                                    "and the space).")] = None,
          verbose: Verbose = False) -> None:
    """Search config fields with an Optuna study (TPE, median pruning on the evaluation loss); every trial is a
    pipeline run reusing the data stages; the best trial alone goes through the registry gate. Run it again to
    resume."""
    if not space:
        raise ConfigError("llmops sweep needs --space SPACE.yaml: the config fields to search and their "
                          "distributions")
    workspace = configure_environment(verbose)
    overrides = tracking.without_credentials(overrides or [])
    from llmops.flows.sweep import prepare, run_sweep

    prepared = prepare(config, overrides, space, storage)
    check_launch(prepared.config)
    tracking.check_reachable(prepared.config.tracking)
    check_registered_base(prepared.config)
    show_progress(verbose)
    console.print(f"[bold]sweep[/] · {config} · space {space} · {trials} trials, {parallel} at a time · workspace "
                  f"{workspace} · study storage {mask(prepared.storage)}", highlight=False, soft_wrap=True)
    try:
        with terminate_as_interrupt():
            result = run_sweep(prepared, trials, parallel, study)
    except (KeyboardInterrupt, Interrupted):
        fail("interrupted; finished trials are kept in the study. Run the same command to resume.", code=130)
    console.print(trials_table(result.study, result.metric, result.direction, result.rows))
    if result.reclaimed:
        console.print(f"trials {', '.join(map(str, result.reclaimed))} did not finish (their process was killed "
                      "or stopped): asked again with the same parameters", highlight=False)
    registration = result.registration
    if registration is None:
        fail(f"no trial of study {result.study} completed: nothing registered", code=1)
    console.print(f"best: trial {result.best_trial} · MLflow run {result.parent_run} (the study) · registered "
                  f"{registration.model_name} version {registration.version} → {registration.alias or 'no alias'}: "
                  f"{registration.reason}", highlight=False, soft_wrap=True)
    if registration.message:
        console.print(registration.message, highlight=False, soft_wrap=True)
        raise typer.Exit(1)


def trials_table(study: str, metric: str, direction: str, rows: list[dict[str, Any]]) -> Table:
    params = sorted({key for row in rows for key in row if key.startswith("param.")})
    table = Table(title=f"study {study} ({direction} {metric})")
    for column in ("trial", "state", metric, "pruned at step", *(p.removeprefix("param.") for p in params)):
        table.add_column(column, justify="right" if column != "state" else "left")
    for row in rows:
        value = row["value"]
        table.add_row(str(row["trial"]), row["state"], f"{value:.4g}" if isinstance(value, float) else "",
                      str(row["pruned_at_step"] or ""), *(shown(row.get(p)) for p in params))
    return table


def shown(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else "" if value is None else str(value)
