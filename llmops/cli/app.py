"""The `llmops` command: run the pipeline, list registered models and ask them, manage the data versions.

Every command ends a user error (io/errors.py) with one line and exit code 2.
"""

from __future__ import annotations

import faulthandler
import signal
import sys

import typer

from llmops.cli import benchmark, data, models, monitor, pipeline, serving, sweep
from llmops.cli.io import one_line_errors, say_error

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__, pretty_exceptions_show_locals=False)
app.add_typer(models.app, name="models")
app.add_typer(data.app, name="data")
for name, command in (("run", pipeline.run), ("stage", pipeline.stage), ("config", pipeline.show_config),
                      ("plan", pipeline.plan), ("dvc-yaml", pipeline.dvc_yaml), ("runs", pipeline.runs),
                      ("deploy", pipeline.deploy), ("predict", serving.predict),
                     ("serve", serving.serve), ("monitor", monitor.monitor), ("sweep", sweep.sweep),
                     ("evaluate", benchmark.evaluate)):
    app.command(name)(one_line_errors(command))


def main() -> None:
    dump_stacks_on_sigusr1()
    sys.exit(run(sys.argv[1:]))


def run(args: list[str]) -> int:
    """The command's exit code. A usage error (an unknown option, an option without its value, a bad value) is one
    line and exit code 2, as every user error is, where Typer would draw a box of several; help, asked for or shown
    for a command given no arguments, prints as it does."""
    usage_error, command_error = click_errors()
    try:
        code = app(args=args, prog_name="llmops", standalone_mode=False)
    except usage_error as err:
        if type(err).__name__ == "NoArgsIsHelpError":  # no arguments: the command's help
            err.show()
            return err.exit_code
        where = err.ctx.command_path if err.ctx is not None else "llmops"
        say_error(f"{where}: {err.format_message()} (see {where} --help)")
        return err.exit_code
    except command_error as err:
        say_error(err.format_message())
        return err.exit_code
    except typer.Abort:
        say_error("aborted")
        return 1
    return code if isinstance(code, int) else 0


def click_errors() -> tuple[type[Exception], type[Exception]]:
    """The UsageError and ClickException classes Typer raises: Typer exports neither, and they are those of the click
    it carries within (or of click itself, in older Typer), so they are found among its public BadParameter's bases."""
    bases = {cls.__name__: cls for cls in typer.BadParameter.__mro__}
    return bases["UsageError"], bases["ClickException"]


def dump_stacks_on_sigusr1() -> None:
    """`kill -USR1 <pid>` prints every thread's stack to stderr and the command goes on: what a run that seems
    stuck is waiting for (POSIX only)."""
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)


if __name__ == "__main__":
    main()
