"""The command's input and output: one console, errors as one line, progress, prediction rows in and out."""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape

from llmops.io.errors import MissingInputError, UserError
from llmops.store.settings import mask

console = Console()
# errors go to standard error, so that output piped or redirected elsewhere still leaves them on the terminal
errors = Console(stderr=True)
# a path the command reads rows from; "-" is standard input
STDIN = "-"


def fail(message: str, code: int = 2, to: Console | None = None) -> NoReturn:
    """One line, secrets masked, and the exit code (2: something for the user to fix)."""
    say_error(message, to)
    raise typer.Exit(code)


def say_error(message: str, to: Console | None = None) -> None:
    """The error as one line, secrets masked."""
    # one line whatever the message quotes: newlines between its lines, other control characters escaped
    line = "".join(c if c.isprintable() else repr(c)[1:-1] for c in " ".join(mask(message).splitlines()))
    # the message quotes data and library errors: "[Errno 28]" is text, not markup
    (to or errors).print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)


def one_line_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """A command whose user errors (io/errors.py: bad config or data, a server down, a full disk) end as one line
    and exit code 2, not a traceback; anything else is a bug and keeps its traceback."""
    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except UserError as err:
            fail(str(err))

    return run


class ProgressHandler(RichHandler):
    """The command's progress lines on its console; one per process, however many commands run in it."""


def show_progress(verbose: bool) -> None:
    logger = logging.getLogger("llmops")
    for old in [handler for handler in logger.handlers if isinstance(handler, ProgressHandler)]:
        logger.removeHandler(old)
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)
    logger.addHandler(ProgressHandler(console=console, show_path=False, show_level=verbose, markup=False,
                                      log_time_format="%H:%M:%S"))


def open_rows(path: str) -> tuple[Any, int | None]:
    """The input as a binary stream, and its number of non-blank lines when it is a file (for the progress bar)."""
    if path == STDIN:
        return sys.stdin.buffer, None
    file = Path(path)
    if not file.is_file():
        raise MissingInputError(f"{path}: no such input file")
    with file.open("rb") as handle:
        total = sum(1 for line in handle if line.strip())
    return file.open("rb"), total


def write_results(results: Any, total: int | None, output: str | None, errors: Console) -> list[int]:
    """Write one JSON line per result, with a progress bar on stderr; return the lines that failed."""
    from contextlib import nullcontext

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from llmops.serving.predict import dump

    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
    bad: list[int] = []
    columns = (TextColumn("predicting"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with open(output, "w", encoding="utf-8") if output else nullcontext(sys.stdout) as sink, \
            Progress(*columns, console=errors) as progress:
        task = progress.add_task("rows", total=total)
        for result in results:
            sink.write(dump(result) + "\n")
            if "error" in result:
                bad.append(result["line"])
                progress.console.print(f"line {result['line']}: {result['error']}", highlight=False, markup=False,
                                       soft_wrap=True)
            progress.advance(task)
    return bad


def write_if_changed(target: Path, text: str) -> None:
    """Write the file unless it holds these bytes already (DVC and make see an untouched file as unchanged); a
    target that cannot be written (a folder, no permission) is one line naming it."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.is_file() or target.read_text() != text:
            target.write_text(text)
    except OSError as err:
        raise UserError(f"cannot write {target} ({err.strerror or err})") from None
