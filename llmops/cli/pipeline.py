"""Commands that run the pipeline or show what it would do: run, stage, plan, config, dvc-yaml, runs, deploy."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from llmops.cli.environment import configure_environment
from llmops.cli.io import console, fail, show_progress, write_if_changed
from llmops.cli.render import plan_table, print_summary, runs_table
from llmops.config.schema import PipelineConfig
from llmops.io.errors import Interrupted
from llmops.io.files import project_root
from llmops.objectives import handing, load_config
from llmops.pipeline.stages import NAMES
from llmops.store.settings import mask
from llmops.tracking import log as tracking

DEFAULT_CONFIG = "configs/default.yaml"
ConfigArg = Annotated[str, typer.Argument(help="Pipeline config (YAML).")]
ConfigOpt = Annotated[str, typer.Option("--config", "-c", help="Pipeline config (YAML).")]
Overrides = Annotated[list[str] | None, typer.Argument(help="section.key=value overrides.")]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Show library and Prefect logs too.")]


Force = Annotated[bool, typer.Option("--force", help="Run the flow even when nothing changed since the last run.")]


def run(config: ConfigArg = DEFAULT_CONFIG, overrides: Overrides = None, verbose: Verbose = False,
        force: Force = False) -> None:
    """Run the training pipeline: ingest, validate, dedup, tokenize, train, evaluate, register."""
    workspace = configure_environment(verbose)
    # credentials in a tracking URI go to the environment, not into the flow run's recorded parameters
    overrides = tracking.without_credentials(overrides or [])
    resolved = load_config(config, overrides)
    from llmops.pipeline.up_to_date import remember_run, unchanged_stages
    from llmops.registry.presence import still_registered

    stages = None if force else unchanged_stages(resolved)
    unchanged = None if stages is None else still_registered(resolved.tracking, stages)
    if unchanged is not None:
        registration = unchanged["registration"]
        console.print(f"[bold]up to date[/]: every stage of {config} is in the workspace and "
                      f"{registration['model_name']}/{registration['version']} holds its model; nothing ran "
                      "(--force runs the flow anyway)", highlight=False, soft_wrap=True)
        finish(resolved, unchanged)
        return
    check_launch(resolved)
    tracking.check_reachable(resolved.tracking)  # before any work
    check_registered_base(resolved)
    show_progress(verbose)
    from llmops.flows.api import start_embedded_api
    from llmops.flows.pipeline import training_pipeline

    try:
        start_embedded_api()
    except RuntimeError as err:  # e.g. it did not answer within PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS
        fail(f"the local Prefect API did not start: {str(err).splitlines()[0] if str(err) else err!r}")
    where = mask(tracking.tracking_uri(resolved.tracking))
    console.print(f"[bold]training_pipeline[/] · {config} · workspace {workspace} · tracking {where}",
                  highlight=False, soft_wrap=True)
    try:
        # the flow takes the config loaded above rather than parsing the file again
        with console.status("running the pipeline…"), terminate_as_interrupt(), handing(resolved, config, overrides):
            summary = training_pipeline(config_path=config, overrides=overrides)
    except (KeyboardInterrupt, Interrupted) as err:
        stopped = str(err) if isinstance(err, Interrupted) else (
            "interrupted; finished stages are kept and the one that was running starts over")
        fail(f"{stopped}. Run the same command to resume.", code=130)
    remember_run(resolved, summary)
    finish(resolved, summary)


def finish(config: PipelineConfig, summary: dict[str, Any]) -> None:
    """The run's summary; a registered model that nothing should use ends the command with 1."""
    print_summary(config, summary)
    message = summary["registration"].get("message")
    if message:
        # the run's last line: the model it made is registered, but nothing should use it
        console.print(message, highlight=False, soft_wrap=True)
        raise typer.Exit(1)


def check_launch(config: PipelineConfig) -> None:
    """A training this machine cannot run as configured stops before any stage runs (unless it runs elsewhere)."""
    if config.launch.work_pool:
        return
    from llmops.training.launch import plan_launch

    plan_launch(config.train)


def check_registered_base(config: PipelineConfig) -> None:
    """A registered starting model (models:/NAME@alias) that does not exist stops the run before any stage."""
    from llmops.registry import bases
    from llmops.registry.references import is_registered

    if is_registered(config.model.name_or_path):
        bases.resolve(config.model.name_or_path, config.tracking)


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


def stage(name: Annotated[str, typer.Argument(help=f"One of: {', '.join(NAMES)}.")],
          config: ConfigOpt = DEFAULT_CONFIG, verbose: Verbose = False) -> None:
    """Run one stage on the records of the stages before it (what `dvc repro` calls)."""
    from llmops.pipeline.runner import run_alone
    from llmops.pipeline.stages import stage as table_entry

    table_entry(name)
    configure_environment(verbose)
    show_progress(verbose)
    run_alone(name, load_config(config))


def show_config(config: ConfigArg = DEFAULT_CONFIG, overrides: Overrides = None,
                output: Annotated[str | None, typer.Option("--output", "-o", help="Write it to this file.")] = None,
                ) -> None:
    """The resolved config, every default filled in, as YAML."""
    import yaml

    text = yaml.safe_dump(load_config(config, overrides or []).as_dict(), sort_keys=True)
    if output is None:
        typer.echo(text, nl=False)
        return
    write_if_changed(Path(output), text)


def plan(config: ConfigArg = DEFAULT_CONFIG, overrides: Overrides = None) -> None:
    """Each stage's key for this config, and whether a run would reuse its artifact or compute it."""
    from llmops.pipeline.runner import planned

    configure_environment()
    console.print(plan_table(config, planned(load_config(config, overrides or []))))


def dvc_yaml(check: Annotated[bool, typer.Option("--check", help="Only say whether dvc.yaml is what the stage "
                                                                  "table gives; exit 1 when it is not.")] = False,
             ) -> None:
    """Write dvc.yaml from the stage table (the stages of configs/default.yaml)."""
    from llmops.data.versions import DVC_PIPELINE_CONFIG
    from llmops.pipeline.dvcfile import render_dvc_yaml

    path = project_root() / "dvc.yaml"
    text = render_dvc_yaml(load_config(project_root() / DVC_PIPELINE_CONFIG), DVC_PIPELINE_CONFIG, project_root())
    if check:
        same = path.is_file() and path.read_text() == text
        console.print("dvc.yaml is up to date" if same else "dvc.yaml differs from the stage table: run "
                      "`llmops dvc-yaml`", highlight=False)
        raise typer.Exit(0 if same else 1)
    path.write_text(text)
    console.print(f"wrote {path}", highlight=False)


def runs(config: ConfigOpt = DEFAULT_CONFIG,
         limit: Annotated[int, typer.Option(help="How many of the newest runs.")] = 20) -> None:
    """Recent pipeline runs with their status, and which run resumed or closed which."""
    configure_environment()
    resolved = load_config(config)
    console.print(runs_table(resolved.tracking.experiment, tracking.recent_runs(resolved.tracking, limit)))


def deploy(gpu_limit: Annotated[int, typer.Option("--gpu-limit", min=1, help="Trainings at once on the gpu "
                                                                             "pool.")] = 1,
           prefect_file: Annotated[str, typer.Option("--prefect-file", help="The deployments to create.")] =
           "prefect.yaml", config: ConfigOpt = DEFAULT_CONFIG) -> None:
    """Create the work pools, the gpu concurrency limit, the automation that crashes a sent stage whose heartbeats
    stopped, the deployments of prefect.yaml on the Prefect server, and (monitor.retrain_on_drift) the automation
    that retrains on drift."""
    configure_environment()
    from llmops.flows.deploy import deploy_all

    for line in deploy_all(prefect_file, gpu_limit, load_config(config).monitor.retrain_on_drift):
        console.print(line, highlight=False, soft_wrap=True)
