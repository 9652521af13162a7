"""The `llmops` command: run the pipeline, list registered models and ask them, manage the data versions.

Every command ends a user error (core/errors.py) with one line and exit code 2.
"""

from __future__ import annotations

import faulthandler
import signal
import sys

import typer

from llmops.flows.cli import data, models, pipeline, serving, sweep
from llmops.flows.cli.io import one_line_errors

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__, pretty_exceptions_show_locals=False)
app.add_typer(models.app, name="models")
app.add_typer(data.app, name="data")
for name, command in (("run", pipeline.run), ("stage", pipeline.stage), ("config", pipeline.show_config),
                      ("plan", pipeline.plan), ("dvc-yaml", pipeline.dvc_yaml), ("runs", pipeline.runs),
                      ("deploy", pipeline.deploy), ("predict", serving.predict),
                     ("serve", serving.serve), ("sweep", sweep.sweep)):
    app.command(name)(one_line_errors(command))


def main() -> None:
    dump_stacks_on_sigusr1()
    sys.exit(app())


def dump_stacks_on_sigusr1() -> None:
    """`kill -USR1 <pid>` prints every thread's stack to stderr and the command goes on: what a run that seems
    stuck is waiting for (POSIX only)."""
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)


if __name__ == "__main__":
    main()
