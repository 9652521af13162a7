"""`llmops monitor NAME`: what the service answered, how fast and how well, and whether its inputs drift;
`llmops monitor export NAME --output FILE`: rated requests as the next dataset version."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any

import typer

from llmops.cli.environment import configure_environment
from llmops.cli.io import console, errors, fail
from llmops.cli.pipeline import DEFAULT_CONFIG, ConfigOpt
from llmops.io.errors import UserError
from llmops.objectives import load_config

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")


def monitor(
    words: Annotated[list[str], typer.Argument(help="NAME, or `export NAME` (with --output).", show_default=False)],
    since: Annotated[str, typer.Option(help="The window: requests of the last DURATION (90s, 30m, 24h, 7d).")] = "24h",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
    output: Annotated[
        str | None, typer.Option("--output", "-o", help="export: the JSONL file rows are added to.")
    ] = None,
    pin: Annotated[
        bool,
        typer.Option(
            help="export: pin the file as a DVC data version (the data-change path then retrains) and announce it."
        ),
    ] = True,
    config: ConfigOpt = DEFAULT_CONFIG,
) -> None:
    """Traffic per version, errors, latency p50/p95/p99, tokens, truncated prompts, feedback over time and drift
    against each version's training data (logged to MLflow; drift sends llmops.model.drifted to a Prefect server).

    `llmops monitor export NAME --output FILE` turns rated requests into rows of the pipeline's kinds (corrections,
    preferred answers, labels), minus rows the version trained on and questions of the frozen evaluation set.
    """
    configure_environment()
    name, exporting = command_of(words)
    try:
        seconds = duration(since)
        resolved = load_config(config)
        if exporting:
            export(resolved, name, seconds, output, pin, as_json)
        else:
            report(resolved, name, seconds, as_json)
    except UserError as err:
        fail(str(err))


def command_of(words: list[str]) -> tuple[str, bool]:
    if len(words) == 1 and words[0] != "export":
        return words[0], False
    if len(words) == 2 and words[0] == "export":
        return words[1], True
    fail("llmops monitor: expected NAME or `export NAME` (see llmops monitor --help)")
    raise AssertionError  # fail() exits


def duration(text: str) -> float:
    found = DURATION.match(text)
    if found is None or float(found.group(1)) <= 0:
        raise UserError(f"--since {text!r}: expected a positive number and a unit, e.g. 90s, 30m, 24h, 7d")
    return float(found.group(1)) * UNITS[found.group(2)]


def report(config: Any, name: str, seconds: float, as_json: bool) -> None:
    from llmops.monitoring.monitor import drifted_versions, log_report, monitor

    found = monitor(config, name, seconds)
    run_id = log_report(config, found)
    drifted = drifted_versions(found)
    sent = announce(name, {version: found["versions"][version]["drift"] for version in drifted})
    if as_json:
        print(json.dumps({**found, "mlflow_run_id": run_id, "events": sent}, ensure_ascii=False))
        return
    from llmops.cli.render import monitor_tables

    for table in monitor_tables(found):
        console.print(table)
    for version in drifted:
        checks = found["versions"][version]["drift"]["checks"]
        names = ", ".join(
            f"{check} (p={tested['p_value']:.2g})" for check, tested in checks.items() if tested["drifted"]
        )
        console.print(f"[yellow]drift:[/] {version}: {names}", highlight=False, soft_wrap=True)
    console.print(
        f"logged as MLflow run {run_id}" + (f"; {len(sent)} drift event(s) sent" if sent else ""), highlight=False
    )


def announce(name: str, drifted: dict[str, dict[str, Any]]) -> list[str]:
    """Send llmops.model.drifted; the report stands, so a server that is down only warns."""
    from llmops.flows.events import MODEL_DRIFTED, announce_drift

    try:
        return [str(event.id) for event in announce_drift(name, drifted) or []]
    except Exception as err:  # the websocket client raises whatever the connection did
        console.print(f"[yellow]warning:[/] {MODEL_DRIFTED} not sent: {type(err).__name__}: {err}", highlight=False)
        return []


def export(config: Any, name: str, seconds: float, output: str | None, pin: bool, as_json: bool) -> None:
    if output is None:
        raise UserError("llmops monitor export: give --output FILE (a JSONL file the rows are added to)")
    from llmops.monitoring.monitor import export as export_rows

    exported = export_rows(config, name, seconds, Path(output))
    pinned = pin_files(list(exported.files.values())) if pin and exported.added else []
    if as_json:
        print(json.dumps({**exported.summary(), "pinned": pinned}, ensure_ascii=False))
        return
    for kind, path in exported.files.items():
        console.print(
            f"{path}: {exported.added[kind]} {kind} rows added, {exported.kept[kind]} kept from before",
            highlight=False,
            soft_wrap=True,
        )
    for reason, count in sorted(exported.dropped.items()):
        console.print(f"not exported: {count} ({reason})", highlight=False, soft_wrap=True)
    for line in pinned:
        console.print(line, highlight=False, soft_wrap=True)


def pin_files(paths: list[Path]) -> list[str]:
    """Each written file as a DVC data version, announced as `llmops data add` announces it (a Prefect server that
    is down only warns: the rows are written and pinned)."""
    from llmops.data.versions import add_dataset, added_message
    from llmops.flows.events import DATA_UPDATED, announce_data

    lines = []
    for path in paths:
        added = add_dataset(str(path))
        lines.append(added_message(added))
        try:
            announce_data([added], "add")
        except Exception as err:  # the websocket client raises whatever the connection did
            errors.print(f"[yellow]warning:[/] {DATA_UPDATED} not sent: {type(err).__name__}: {err}", highlight=False)
    return lines
