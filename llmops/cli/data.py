"""`llmops data`: dataset versions with DVC (init, add, push, pull) and the events that announce them."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from llmops.cli.environment import configure_environment
from llmops.cli.io import console, one_line_errors
from llmops.io.errors import UserError
from llmops.io.files import project_root

app = typer.Typer(no_args_is_help=True, help="Dataset versions (DVC).")
RemoteOpt = Annotated[str | None, typer.Option("--remote", "-r", help="A DVC remote (default: the default one).")]


@app.command("init")
@one_line_errors
def data_init() -> None:
    """Bring the default dataset into data/: pull it from the DVC remote, or regenerate it, and check it."""
    configure_environment()
    from llmops.data.versions import ensure_default_dataset

    console.print(ensure_default_dataset(), highlight=False)


@app.command("add")
@one_line_errors
def data_add(path: Annotated[str, typer.Argument(help="A file or folder inside the project.")]) -> None:
    """Pin a new dataset version with DVC (writes PATH.dvc); tell the Prefect server, if there is one."""
    configure_environment()
    from llmops.data.versions import add_dataset, added_message

    added = add_dataset(path)
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


@app.command("push")
@one_line_errors
def data_push(remote: RemoteOpt = None) -> None:
    """Store the pinned dataset versions on a DVC remote."""
    transfer("push", remote)


@app.command("pull")
@one_line_errors
def data_pull(remote: RemoteOpt = None) -> None:
    """Bring the pinned dataset versions from a DVC remote into the workspace."""
    transfer("pull", remote)


class TransferError(UserError, RuntimeError):
    """DVC could not push or pull."""


def transfer(direction: str, remote: str | None) -> None:
    configure_environment()
    from dvc.exceptions import DvcException

    from llmops.data import versions

    move = versions.push_dataset if direction == "push" else versions.pull_dataset
    try:
        console.print(move(remote), highlight=False, soft_wrap=True)
    except DvcException as err:
        raise TransferError(f"dvc {direction} failed: {err}") from None
    if direction == "push":
        announce(versions.pinned_datasets(project_root()), "push")
