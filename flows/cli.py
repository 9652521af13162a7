"""The `llmops` command: run the pipeline, list registered models, manage the default data."""

from __future__ import annotations

import json
import logging
import sys
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.table import Table

from flows.environment import configure_environment
from tasks.config import ConfigError, PipelineConfig, load_config
from tasks.stages import NAMES

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__, pretty_exceptions_show_locals=False)
models_app = typer.Typer(no_args_is_help=True, help="Registered model versions.")
data_app = typer.Typer(no_args_is_help=True, help="Dataset versions (DVC).")
app.add_typer(models_app, name="models")
app.add_typer(data_app, name="data")
console = Console()
DEFAULT_CONFIG = "configs/default.yaml"

ConfigArg = Annotated[str, typer.Argument(help="Pipeline config (YAML).")]
ConfigOpt = Annotated[str, typer.Option("--config", "-c", help="Pipeline config (YAML).")]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Show library and Prefect logs too.")]


def expected_errors() -> tuple[type[BaseException], ...]:
    """Errors that are the user's to fix (bad data or config, a full disk, a server that is down): reported as one
    line, not a traceback."""
    from tasks.dedup import EmptySplitError
    from tasks.ingest import DataSourceError
    from tasks.modeling import HardwareError, UnsafeCheckpointError
    from tasks.templates import TemplateError
    from tasks.tracking import TrackingUnavailableError
    from tasks.validate import DataQualityError
    from tasks.workspace import StorageFullError

    return (ConfigError, DataSourceError, DataQualityError, EmptySplitError, FileNotFoundError, HardwareError,
            TemplateError, TrackingUnavailableError, StorageFullError, UnsafeCheckpointError)


def fail(message: str, code: int = 2) -> None:
    from tasks.tracking import mask_secrets

    # one line whatever the message quotes: newlines between its lines, other control characters escaped
    line = "".join(c if c.isprintable() else repr(c)[1:-1] for c in " ".join(mask_secrets(message).splitlines()))
    # the message quotes data and library errors: "[Errno 28]" is text, not markup
    console.print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def show_progress(verbose: bool) -> None:
    handler = RichHandler(console=console, show_path=False, show_level=verbose, markup=False,
                          log_time_format="%H:%M:%S")
    logger = logging.getLogger("llmops")
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)


@app.command()
def run(
    config: ConfigArg = DEFAULT_CONFIG,
    overrides: Annotated[list[str] | None, typer.Argument(help="section.key=value overrides.")] = None,
    verbose: Verbose = False,
) -> None:
    """Run the training pipeline: ingest, validate, dedup, tokenize, train, evaluate, register."""
    from tasks import tracking

    workspace = configure_environment(verbose)
    # credentials in a tracking URI go to the environment, not into the flow run's recorded parameters
    overrides = tracking.without_credentials(overrides or [])
    try:
        resolved = load_config(config, overrides)
        tracking.check_reachable(resolved.tracking)  # before any work
    except expected_errors() as err:
        fail(str(err))
    show_progress(verbose)
    from flows.environment import start_local_prefect
    from flows.pipeline import training_pipeline

    try:
        start_local_prefect()
    except RuntimeError as err:  # e.g. it did not answer within PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS
        fail(f"the local Prefect API did not start: {str(err).splitlines()[0] if str(err) else err!r}")

    where = tracking.mask_secrets(tracking.tracking_uri(resolved.tracking))
    console.print(f"[bold]training_pipeline[/] · {config} · workspace {workspace} · tracking {where}",
                  highlight=False, soft_wrap=True)
    try:
        with console.status("running the pipeline…"):
            summary = training_pipeline(config_path=config, overrides=overrides)
    except expected_errors() as err:
        fail(str(err))
    print_summary(resolved, summary)


def print_summary(config: PipelineConfig, summary: dict[str, Any]) -> None:
    from tasks.tracking import is_local_store, mask_secrets, tracking_uri
    from tasks.workspace import home

    registration = summary["registration"]
    stages = Table(title="stages", show_header=False)
    for stage, status in summary["stages"].items():
        stages.add_row(stage, f"[green]{status}[/]" if status == "computed" else f"[cyan]{status}[/]")
    console.print(stages)
    metrics = Table(title="held-out metrics")
    names = list(registration["metrics"])
    metrics.add_column("metric")
    for name in names:
        metrics.add_column(name, justify="right")
    for metric in registration["metrics"]["trained"]:
        marker = " (primary)" if metric == registration["primary_metric"] else ""
        metrics.add_row(metric + marker, *(f"{registration['metrics'][n][metric]:.4g}" for n in names))
    console.print(metrics)
    alias = registration["alias"] or "no alias"
    note = " (already registered: same weights)" if registration["reused"] else ""
    console.print(f"registered [bold]{registration['model_name']}[/] version [bold]{registration['version']}[/]"
                  f" → [bold]{alias}[/]{note}", highlight=False)
    workspace = home()
    console.print("look closer:", highlight=False)
    uri = mask_secrets(tracking_uri(config.tracking))
    ui = f"mlflow ui --host 127.0.0.1 --backend-store-uri {uri}" if is_local_store(config.tracking) else uri
    console.print(f"  {ui}  (run {summary['mlflow_run_id']})", highlight=False, soft_wrap=True)
    console.print(f"  PREFECT_HOME={workspace / 'prefect'} prefect server start --host 127.0.0.1", highlight=False,
                  soft_wrap=True)


@models_app.command("list")
def models_list(
    config: ConfigOpt = DEFAULT_CONFIG,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Registered versions with their aliases, metrics and lineage tags."""
    configure_environment()
    try:
        resolved = load_config(config)
    except ConfigError as err:
        fail(str(err))
    from tasks.register import list_versions

    versions = list_versions(resolved.tracking)
    if as_json:
        typer.echo(json.dumps(versions, indent=2))
        return
    table = Table(title="registered models")
    for column in ("version", "aliases", "primary metric: trained vs baseline", "commit", "data md5", "flow run"):
        table.add_column(column, overflow="fold")
    for v in versions:
        tags = v["tags"]
        table.add_row(f"{v['name']}/{v['version']}", ", ".join(v["aliases"]),
                      f"{v['primary_metric']} {v['trained']} vs {v['baseline']}", tags.get("git_commit", "")[:8],
                      tags.get("dvc_data_md5", "")[:8], tags.get("prefect_flow_run_id", "")[:8])
    console.print(table)


@data_app.command("init")
def data_init() -> None:
    """Bring the default dataset into data/: pull it from the DVC remote, or regenerate it, and check it."""
    configure_environment()
    from tasks.versions import ensure_default_dataset

    try:
        console.print(ensure_default_dataset(), highlight=False)
    except (RuntimeError, FileNotFoundError) as err:
        fail(str(err))


@data_app.command("add")
def data_add(path: Annotated[str, typer.Argument(help="A file or folder inside the project.")]) -> None:
    """Pin a new dataset version with DVC (writes PATH.dvc)."""
    configure_environment()
    from tasks.versions import add_dataset

    try:
        console.print(add_dataset(path), highlight=False, soft_wrap=True)
    except FileNotFoundError as err:
        fail(str(err))


RemoteOpt = Annotated[str | None, typer.Option("--remote", "-r", help="A DVC remote (default: the default one).")]


@data_app.command("push")
def data_push(remote: RemoteOpt = None) -> None:
    """Store the pinned dataset versions on a DVC remote."""
    transfer("push", remote)


@data_app.command("pull")
def data_pull(remote: RemoteOpt = None) -> None:
    """Bring the pinned dataset versions from a DVC remote into the workspace."""
    transfer("pull", remote)


def transfer(direction: str, remote: str | None) -> None:
    configure_environment()
    from dvc.exceptions import DvcException

    from tasks import versions

    move = versions.push_dataset if direction == "push" else versions.pull_dataset
    try:
        console.print(move(remote), highlight=False, soft_wrap=True)
    except versions.RemoteSyncError as err:
        fail(str(err))
    except DvcException as err:
        fail(f"dvc {direction} failed: {err}")


@app.command()
def stage(
    name: Annotated[str, typer.Argument(help=f"One of: {', '.join(NAMES)}.")],
    config: ConfigOpt = DEFAULT_CONFIG,
    verbose: Verbose = False,
) -> None:
    """Run one stage on the records of the stages before it (what `dvc repro` calls)."""
    if name not in NAMES:
        fail(f"unknown stage {name!r}; expected one of: {', '.join(NAMES)}")
    configure_environment(verbose)
    show_progress(verbose)
    try:
        resolved = load_config(config)
        from flows.stages import run_alone

        run_alone(name, resolved)
    except expected_errors() as err:
        fail(str(err))


@app.command("config")
def show_config(
    config: ConfigArg = DEFAULT_CONFIG,
    overrides: Annotated[list[str] | None, typer.Argument(help="section.key=value overrides.")] = None,
    output: Annotated[str | None, typer.Option("--output", "-o", help="Write it to this file.")] = None,
) -> None:
    """The resolved config, every default filled in, as YAML."""
    import yaml

    try:
        resolved = load_config(config, overrides or [])
    except ConfigError as err:
        fail(str(err))
    text = yaml.safe_dump(resolved.as_dict(), sort_keys=True)
    if output is None:
        typer.echo(text, nl=False)
        return
    from pathlib import Path

    target = Path(output)
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.is_file() or target.read_text() != text:
        target.write_text(text)


@app.command()
def plan(
    config: ConfigArg = DEFAULT_CONFIG,
    overrides: Annotated[list[str] | None, typer.Argument(help="section.key=value overrides.")] = None,
) -> None:
    """Each stage's key for this config, and whether a run would reuse its artifact or compute it."""
    configure_environment()
    try:
        resolved = load_config(config, overrides or [])
        from flows.stages import planned

        rows = planned(resolved)
    except expected_errors() as err:
        fail(str(err))
    table = Table(title=f"plan · {config}")
    for column in ("stage", "key", "would be"):
        table.add_column(column)
    for name, key, status in rows:
        table.add_row(name, key, f"[cyan]{status}[/]" if status == "reused" else f"[green]{status}[/]")
    console.print(table)


@app.command("dvc-yaml")
def dvc_yaml(
    check: Annotated[bool, typer.Option("--check", help="Only say whether dvc.yaml is what the stage table "
                                                         "gives; exit 1 when it is not.")] = False,
) -> None:
    """Write dvc.yaml from the stage table (the stages of configs/default.yaml)."""
    from flows.dvcfile import render_dvc_yaml
    from tasks.workspace import project_root

    path = project_root() / "dvc.yaml"
    text = render_dvc_yaml(project_root())
    if check:
        same = path.is_file() and path.read_text() == text
        console.print("dvc.yaml is up to date" if same else "dvc.yaml differs from the stage table: run "
                      "`llmops dvc-yaml`", highlight=False)
        raise typer.Exit(0 if same else 1)
    path.write_text(text)
    console.print(f"wrote {path}", highlight=False)


def main() -> None:
    sys.exit(app())


if __name__ == "__main__":
    main()
