"""`llmops models`: registered versions listed, shown, promoted, rolled back and exported."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from llmops.cli.environment import configure_environment
from llmops.cli.io import console, one_line_errors
from llmops.cli.pipeline import DEFAULT_CONFIG, ConfigOpt
from llmops.cli.render import print_version, versions_table
from llmops.objectives import load_config

app = typer.Typer(no_args_is_help=True, help="Registered model versions.")
ModelRef = Annotated[str, typer.Argument(help="NAME (its champion), NAME@alias or NAME/version.")]
Reason = Annotated[str, typer.Option("--reason", help="Why, for the alias history.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON.")]


@app.command("list")
@one_line_errors
def models_list(config: ConfigOpt = DEFAULT_CONFIG, as_json: AsJson = False) -> None:
    """Registered versions with their aliases, metrics and lineage tags."""
    configure_environment()
    from llmops.registry.register import list_versions

    versions = list_versions(load_config(config).tracking)
    if as_json:
        typer.echo(json.dumps(versions, indent=2))
        return
    console.print(versions_table(versions))


@app.command("show")
@one_line_errors
def models_show(reference: ModelRef, config: ConfigOpt = DEFAULT_CONFIG, as_json: AsJson = False) -> None:
    """A version's lineage: data, code, config, tokenizer, seed, packages, flow run, trigger, and its alias moves."""
    configure_environment()
    from llmops.registry.register import show_version

    details = show_version(load_config(config).tracking, reference)
    if as_json:
        typer.echo(json.dumps(details, indent=2))
        return
    print_version(details)


@app.command("promote")
@one_line_errors
def models_promote(name: Annotated[str, typer.Argument(help="Registered model name.")],
                   version: Annotated[str, typer.Argument(help="The version to make champion.")],
                   reason: Reason = "", config: ConfigOpt = DEFAULT_CONFIG) -> None:
    """Make a version champion by hand (recorded in the alias history)."""
    configure_environment()
    from llmops.registry import aliases

    said(name, aliases.promote(load_config(config).tracking, name, version, reason))


@app.command("rollback")
@one_line_errors
def models_rollback(name: Annotated[str, typer.Argument(help="Registered model name.")], reason: Reason = "",
                    config: ConfigOpt = DEFAULT_CONFIG) -> None:
    """Give the champion alias back to the previous champion (recorded in the alias history)."""
    configure_environment()
    from llmops.registry import aliases

    said(name, aliases.rollback(load_config(config).tracking, name, reason))


def said(name: str, move: dict[str, str]) -> None:
    was = f" (was version {move['previous']})" if move["previous"] else ""
    console.print(f"{name}: champion → version {move['version']}{was}; {move['reason']}", highlight=False)


@app.command("export")
@one_line_errors
def models_export(reference: ModelRef,
                  folder: Annotated[str, typer.Argument(help="A new (or empty) folder to write.")],
                  to_hub: Annotated[str | None, typer.Option("--to-hub", help="Also push it to this Hub "
                                                                              "repository.")] = None,
                  config: ConfigOpt = DEFAULT_CONFIG) -> None:
    """A folder `from_pretrained` loads: safetensors weights (LoRA merged in), tokenizer, chat template, card."""
    configure_environment()
    from llmops.registry.export import export_version, push_to_hub

    written = export_version(reference, load_config(config).tracking, Path(folder))
    pushed = push_to_hub(Path(folder), to_hub) if to_hub else None
    console.print(f"exported {written['name']} version {written['version']} to {written['folder']}"
                  f"{' (adapter merged into its base)' if written['merged_adapter'] else ''}: "
                  f"{', '.join(written['files'])}", highlight=False, soft_wrap=True)
    if pushed:
        console.print(f"pushed to {pushed}", highlight=False)
