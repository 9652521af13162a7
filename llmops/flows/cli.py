"""The `llmops` command: run the pipeline, list registered models and ask them, manage the default data."""

from __future__ import annotations

import json
import logging
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.table import Table

from llmops.core.config import ConfigError, PipelineConfig, load_config
from llmops.core.stages import NAMES
from llmops.flows.environment import configure_environment

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
    from llmops.core.tracking import TrackingUnavailableError
    from llmops.core.workspace import StorageFullError
    from llmops.data.dedup import EmptySplitError
    from llmops.data.ingest import DataSourceError
    from llmops.data.validate import DataQualityError
    from llmops.models.modeling import HardwareError, UnsafeCheckpointError
    from llmops.registry.gate import RegistryError
    from llmops.text.templates import TemplateError
    from llmops.training.launch import LaunchError

    return (ConfigError, DataSourceError, DataQualityError, EmptySplitError, FileNotFoundError, HardwareError,
            LaunchError, RegistryError, TemplateError, TrackingUnavailableError, StorageFullError,
            UnsafeCheckpointError)


def fail(message: str, code: int = 2, to: Console | None = None) -> None:
    from llmops.core.tracking import mask_secrets

    # one line whatever the message quotes: newlines between its lines, other control characters escaped
    line = "".join(c if c.isprintable() else repr(c)[1:-1] for c in " ".join(mask_secrets(message).splitlines()))
    # the message quotes data and library errors: "[Errno 28]" is text, not markup
    (to or console).print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
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
    from llmops.core import tracking

    workspace = configure_environment(verbose)
    # credentials in a tracking URI go to the environment, not into the flow run's recorded parameters
    overrides = tracking.without_credentials(overrides or [])
    try:
        resolved = load_config(config, overrides)
        check_launch(resolved)
        tracking.check_reachable(resolved.tracking)  # before any work
    except expected_errors() as err:
        fail(str(err))
    show_progress(verbose)
    from llmops.core.workspace import Interrupted
    from llmops.flows.environment import start_embedded_api
    from llmops.flows.pipeline import training_pipeline

    try:
        start_embedded_api()
    except RuntimeError as err:  # e.g. it did not answer within PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS
        fail(f"the local Prefect API did not start: {str(err).splitlines()[0] if str(err) else err!r}")

    where = tracking.mask_secrets(tracking.tracking_uri(resolved.tracking))
    console.print(f"[bold]training_pipeline[/] · {config} · workspace {workspace} · tracking {where}",
                  highlight=False, soft_wrap=True)
    try:
        with console.status("running the pipeline…"), terminate_as_interrupt():
            summary = training_pipeline(config_path=config, overrides=overrides)
    except expected_errors() as err:
        fail(str(err))
    except (KeyboardInterrupt, Interrupted) as err:
        stopped = str(err) if isinstance(err, Interrupted) else (
            "interrupted; finished stages are kept and the one that was running starts over")
        fail(f"{stopped}. Run the same command to resume.", code=130)
    print_summary(resolved, summary)
    message = summary["registration"].get("message")
    if message:
        # the run's last line: the model it made is registered, but nothing should use it
        console.print(message, highlight=False, soft_wrap=True)
        raise typer.Exit(1)


def check_launch(config: PipelineConfig) -> None:
    """A training this machine cannot run as configured stops before any stage runs (unless it runs elsewhere)."""
    if getattr(config.train, "work_pool", None):
        return
    from llmops.training.launch import plan_launch

    plan_launch(config.train)


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (a scheduler stopping the job) ends the run like Ctrl-C: cleanly, with its records closed."""
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def print_summary(config: PipelineConfig, summary: dict[str, Any]) -> None:
    from llmops.core.settings import is_local_store, mask
    from llmops.core.tracking import tracking_uri
    from llmops.core.workspace import home
    from llmops.flows.environment import prefect_api_url

    registration = summary["registration"]
    stages = Table(title="stages", show_header=False)
    for stage, status in summary["stages"].items():
        stages.add_row(stage, f"[green]{status}[/]" if status == "computed" else f"[cyan]{status}[/]")
    console.print(stages)
    console.print(metrics_table(registration))
    if registration.get("comparison"):
        console.print(comparison_table(registration["comparison"], registration["primary_metric"]))
    alias = registration["alias"] or "no alias"
    note = " (already registered: same weights)" if registration["reused"] else ""
    console.print(f"registered [bold]{registration['model_name']}[/] version [bold]{registration['version']}[/]"
                  f" → [bold]{alias}[/]{note}: {registration['reason']}", highlight=False, soft_wrap=True)
    workspace = home()
    uri, api = tracking_uri(config.tracking), prefect_api_url()
    console.print("look closer:", highlight=False)
    mlflow_hint = (f"mlflow ui --host 127.0.0.1 --backend-store-uri {uri}" if is_local_store(uri)
                   else f"MLflow at {mask(uri)}")
    console.print(f"  {mlflow_hint}  (run {summary['mlflow_run_id']})", highlight=False, soft_wrap=True)
    prefect_hint = (f"Prefect at {mask(api)}" if api
                    else f"PREFECT_HOME={workspace / 'prefect'} prefect server start --host 127.0.0.1")
    console.print(f"  {prefect_hint}", highlight=False, soft_wrap=True)
    console.print(f"  llmops models show {registration['model_name']}/{registration['version']}", highlight=False,
                  soft_wrap=True)


def with_interval(value: float, interval: dict[str, float] | None) -> str:
    if not interval:
        return f"{value:.4g}"
    return f"{value:.4g} [{interval['low']:.4g}, {interval['high']:.4g}]"


def metrics_table(registration: dict[str, Any]) -> Table:
    """Trained vs its starting point, each with its 95% interval, and the paired gain; the primary metric's
    choice and reason in the caption."""
    primary, baseline = registration["primary_metric"], registration["baseline"]
    table = Table(title=f"held-out metrics ({registration['examples']} examples, 95% bootstrap intervals)",
                  caption=f"primary metric {primary}: {registration['primary_reason']}", caption_justify="left")
    for column in ("metric", "trained", baseline, "gain"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    intervals, gains = registration["intervals"], registration["gain_over_baseline"]
    for metric, value in registration["metrics"]["trained"].items():
        gain = gains.get(metric)
        table.add_row(metric + (" (primary)" if metric == primary else ""),
                      with_interval(value, intervals.get("trained", {}).get(metric)),
                      with_interval(registration["metrics"][baseline][metric], intervals.get(baseline, {}).get(metric)),
                      with_interval(gain["gain"], gain) if gain else "")
    return table


def comparison_table(comparison: dict[str, Any], primary: str) -> Table:
    table = Table(title=f"against champion version {comparison['champion_version']} on the frozen set "
                        f"({comparison['examples']} examples, md5 {comparison['frozen_md5'][:8]})")
    for column in ("metric", "this version", "champion", "gain"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for metric, gain in comparison["gains"].items():
        table.add_row(metric + (" (primary)" if metric == primary else ""), f"{comparison['candidate'][metric]:.4g}",
                      f"{comparison['champion'][metric]:.4g}", with_interval(gain["gain"], gain))
    return table


def tracking_config(config: str) -> Any:
    try:
        return load_config(config).tracking
    except ConfigError as err:
        fail(str(err))


@models_app.command("list")
def models_list(
    config: ConfigOpt = DEFAULT_CONFIG,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Registered versions with their aliases, metrics and lineage tags."""
    configure_environment()
    settings = tracking_config(config)
    from llmops.registry.register import list_versions

    versions = list_versions(settings)
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


@app.command()
def runs(
    config: ConfigOpt = DEFAULT_CONFIG,
    limit: Annotated[int, typer.Option(help="How many of the newest runs.")] = 20,
) -> None:
    """Recent pipeline runs with their status, and which run resumed or closed which."""
    configure_environment()
    try:
        resolved = load_config(config)
    except ConfigError as err:
        fail(str(err))
    from llmops.core.tracking import recent_runs

    table = Table(title=f"runs · experiment {resolved.tracking.experiment}")
    for column in ("run", "name", "status", "started", "minutes", "resumes", "resumed by", "closed by"):
        table.add_column(column, overflow="fold")
    for entry in recent_runs(resolved.tracking, limit):
        table.add_row(*(str(entry[k] or "") for k in ("run", "name", "status", "started", "minutes", "resumes",
                                                       "resumed_by", "closed_by")))
    console.print(table)


ModelRef = Annotated[str, typer.Argument(help="NAME, NAME@alias or NAME/version.")]
Reason = Annotated[str, typer.Option("--reason", help="Why, for the alias history.")]


@models_app.command("show")
def models_show(
    reference: ModelRef,
    config: ConfigOpt = DEFAULT_CONFIG,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """A version's lineage: data, code, config, tokenizer, seed, packages, flow run, trigger, and its alias moves."""
    configure_environment()
    settings = tracking_config(config)
    from llmops.registry.gate import RegistryError
    from llmops.registry.register import show_version

    try:
        details = show_version(settings, reference)
    except RegistryError as err:
        fail(str(err))
    if as_json:
        typer.echo(json.dumps(details, indent=2))
        return
    print_version(details)


def print_version(details: dict[str, Any]) -> None:
    table = Table(title=f"{details['name']} version {details['version']}", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    skip = {"name", "version", "config", "alias_history", "packages", "metrics", "frozen_comparison"}
    for key, value in details.items():
        if key not in skip and value not in (None, "", []):
            table.add_row(key, ", ".join(value) if isinstance(value, list) else str(value))
    for group in ("packages", "metrics", "frozen_comparison"):
        for key, value in sorted(details[group].items()):
            table.add_row(f"{group}.{key}", str(value))
    console.print(table)
    if details["alias_history"]:
        moves = Table(title="alias moves")
        for column in ("at", "alias", "version", "previous", "action", "by", "reason"):
            moves.add_column(column, overflow="fold")
        for move in details["alias_history"]:
            moves.add_row(*(str(move.get(column) or "") for column in ("at", "alias", "version", "previous", "action",
                                                                      "by", "reason")))
        console.print(moves)
    if details["config"]:
        console.print("[bold]resolved config[/]")
        console.print(details["config"], highlight=False, markup=False)


@models_app.command("promote")
def models_promote(
    name: Annotated[str, typer.Argument(help="Registered model name.")],
    version: Annotated[str, typer.Argument(help="The version to make champion.")],
    reason: Reason = "",
    config: ConfigOpt = DEFAULT_CONFIG,
) -> None:
    """Make a version champion by hand (recorded in the alias history)."""
    move_alias("promote", config, name, version, reason)


@models_app.command("rollback")
def models_rollback(
    name: Annotated[str, typer.Argument(help="Registered model name.")],
    reason: Reason = "",
    config: ConfigOpt = DEFAULT_CONFIG,
) -> None:
    """Give the champion alias back to the previous champion (recorded in the alias history)."""
    move_alias("rollback", config, name, None, reason)


@models_app.command("export")
def models_export(
    reference: Annotated[str, typer.Argument(help="NAME, NAME@alias or NAME/version.")],
    folder: Annotated[str, typer.Argument(help="A new (or empty) folder to write.")],
    to_hub: Annotated[str | None, typer.Option("--to-hub", help="Also push it to this Hub repository.")] = None,
    config: ConfigOpt = DEFAULT_CONFIG,
) -> None:
    """A folder `from_pretrained` loads: safetensors weights (LoRA merged in), tokenizer, chat template, card."""
    from pathlib import Path

    configure_environment()
    settings = tracking_config(config)
    from llmops.registry.export import ExportError, export_version, push_to_hub
    from llmops.serving.predict import PredictError

    try:
        written = export_version(reference, settings, Path(folder))
        pushed = push_to_hub(Path(folder), to_hub) if to_hub else None
    except (ExportError, PredictError) as err:
        fail(str(err))
    console.print(f"exported {written['name']} version {written['version']} to {written['folder']}"
                  f"{' (adapter merged into its base)' if written['merged_adapter'] else ''}: "
                  f"{', '.join(written['files'])}", highlight=False, soft_wrap=True)
    if pushed:
        console.print(f"pushed to {pushed}", highlight=False)


def move_alias(action: str, config: str, name: str, version: str | None, reason: str) -> None:
    configure_environment()
    settings = tracking_config(config)
    from llmops.registry import gate

    try:
        move = gate.promote(settings, name, version, reason) if version is not None else \
            gate.rollback(settings, name, reason)
    except gate.RegistryError as err:
        fail(str(err))
    was = f" (was version {move['previous']})" if move["previous"] else ""
    console.print(f"{name}: champion → version {move['version']}{was}; {move['reason']}", highlight=False)


@data_app.command("init")
def data_init() -> None:
    """Bring the default dataset into data/: pull it from the DVC remote, or regenerate it, and check it."""
    configure_environment()
    from llmops.data.versions import ensure_default_dataset

    try:
        console.print(ensure_default_dataset(), highlight=False)
    except (RuntimeError, FileNotFoundError) as err:
        fail(str(err))


@data_app.command("add")
def data_add(path: Annotated[str, typer.Argument(help="A file or folder inside the project.")]) -> None:
    """Pin a new dataset version with DVC (writes PATH.dvc); tell the Prefect server, if there is one."""
    configure_environment()
    from llmops.data.versions import add_dataset, added_message

    try:
        added = add_dataset(path)
    except FileNotFoundError as err:
        fail(str(err))
    console.print(added_message(added), highlight=False, soft_wrap=True)
    announce([added], "add")


def announce(datasets: list[Any], action: str) -> None:
    """Emit llmops.data.updated; the data command itself has succeeded, so a server that is down only warns."""
    from llmops.flows.events import DATA_UPDATED, announce_data

    try:
        sent = announce_data(datasets, action)
    except Exception as err:  # the websocket client raises whatever the connection did
        console.print(f"[yellow]warning:[/] {DATA_UPDATED} not sent: {type(err).__name__}: {err}", highlight=False)
        return
    for event in sent or []:
        console.print(f"event {event.event} {event.id} for {event.resource.name} (md5 {event.payload['md5']})",
                      highlight=False)


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

    from llmops.data import versions

    move = versions.push_dataset if direction == "push" else versions.pull_dataset
    try:
        console.print(move(remote), highlight=False, soft_wrap=True)
    except versions.RemoteSyncError as err:
        fail(str(err))
    except DvcException as err:
        fail(f"dvc {direction} failed: {err}")
    if direction == "push":
        from llmops.core.workspace import project_root

        announce(versions.pinned_datasets(project_root()), "push")


@app.command()
def deploy(
    gpu_limit: Annotated[int, typer.Option("--gpu-limit", min=1, help="Trainings at once on the gpu pool.")] = 1,
    prefect_file: Annotated[str, typer.Option("--prefect-file", help="The deployments to create.")] = "prefect.yaml",
) -> None:
    """Create the work pools, the gpu concurrency limit and the deployments of prefect.yaml on the Prefect server."""
    configure_environment()
    from llmops.flows.deploy import DeployError, deploy_all

    try:
        for line in deploy_all(prefect_file, gpu_limit):
            console.print(line, highlight=False, soft_wrap=True)
    except DeployError as err:
        fail(str(err))


@app.command()
def predict(
    model: Annotated[str, typer.Argument(help="NAME (its champion), NAME@alias or NAME/VERSION.")],
    input_path: Annotated[str, typer.Option("--input", "-i", help="JSONL rows; - reads standard input.")] = "-",
    output: Annotated[str | None, typer.Option("--output", "-o", help="Write the JSONL results to this file "
                                                                     "(default: standard output).")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", "-b", min=1, help="Rows per forward pass.")] = 32,
    config: ConfigOpt = DEFAULT_CONFIG,
) -> None:
    """A registered version's answers for JSONL rows: replies, labels with scores, perplexities, word tags or mask
    fills.

    Rows take the pipeline's shapes: instruction (optional input), messages, text, or tokens (a list of words).
    Results are JSONL, one per row with its line number; a bad row becomes an error row (and the exit code 1).
    """
    import os

    configure_environment()
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # the progress bar here is ours
    errors = Console(stderr=True)
    from llmops.serving.predict import PredictError, load, parse_reference

    try:
        source, total = open_rows(input_path)
        predictor = load(parse_reference(model), load_config(config).tracking)
    except (ConfigError, PredictError, FileNotFoundError) as err:
        fail(str(err), to=errors)
    errors.print(f"[bold]{predictor.name}/{predictor.version}[/] ({model}) on {predictor.device}: {predictor.limits}",
                 highlight=False, soft_wrap=True)
    with source:
        bad = write_predictions(predictor, source, total, output, batch_size, errors)
    if bad:
        lines = ", ".join(map(str, bad[:20])) + (", …" if len(bad) > 20 else "")
        errors.print(f"{len(bad)} row{'s' if len(bad) != 1 else ''} could not be predicted (line {lines}): "
                     "error rows in the output", highlight=False, soft_wrap=True)
        raise typer.Exit(1)


def open_rows(path: str) -> tuple[Any, int | None]:
    """The input as a binary stream, and its number of non-blank lines when it is a file (for the progress bar)."""
    from pathlib import Path

    if path == "-":
        return sys.stdin.buffer, None
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"{path}: no such input file")
    with file.open("rb") as handle:
        total = sum(1 for line in handle if line.strip())
    return file.open("rb"), total


def write_predictions(predictor: Any, source: Any, total: int | None, output: str | None, batch_size: int,
                      errors: Console) -> list[int]:
    """Write one JSON line per row, with a progress bar on stderr; return the lines that failed."""
    from contextlib import nullcontext
    from pathlib import Path

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from llmops.serving.predict import dump, predict_lines

    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
    bad: list[int] = []
    columns = (TextColumn("predicting"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with open(output, "w", encoding="utf-8") if output else nullcontext(sys.stdout) as sink, \
            Progress(*columns, console=errors) as progress:
        task = progress.add_task("rows", total=total)
        for result in predict_lines(predictor, source, batch_size):
            sink.write(dump(result) + "\n")
            if "error" in result:
                bad.append(result["line"])
                progress.console.print(f"line {result['line']}: {result['error']}", highlight=False, markup=False,
                                       soft_wrap=True)
            progress.advance(task)
    return bad


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
        from llmops.flows.runner import run_alone

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
        from llmops.flows.runner import planned

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
    from llmops.core.workspace import project_root
    from llmops.flows.dvcfile import render_dvc_yaml

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
