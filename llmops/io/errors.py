"""The errors a person fixes, not a programmer: bad config or data, missing hardware, a server that is down.

Every such error derives from `UserError`; the `llmops` command shows it as one line and exits with
code 2, and anything else is a bug and keeps its traceback. Each error also keeps the standard
exception type it has always been (a missing data file is still a FileNotFoundError), so that code
catching those keeps working.

A stage that fails is retried (as often as its stage says) only when trying again can help: a
`UserError` fails the same way until the user changes something, unless it is also `Transient` (a
server or a store that is down, a full disk); an interrupted run stopped because it was asked to.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem the user can act on; the message is one line that says what to change."""


class Transient:
    """Marks a UserError whose cause can pass without a change to the config or the data: a server or a store that
    does not answer, a disk that is full. A stage that raises it is tried again."""


def worth_retrying(error: BaseException | None) -> bool:
    """Whether a stage that failed with `error` may succeed when it is run again as it is."""
    if isinstance(error, Interrupted):
        return False
    return not isinstance(error, UserError) or isinstance(error, Transient)


class ConfigError(UserError, ValueError):
    """A config problem, phrased as one line a person can act on."""


class Interrupted(Exception):
    """The run was asked to stop (a signal) and stopped cleanly; what it saved lets the same command resume."""


class StorageFullError(Transient, UserError, RuntimeError):
    """An artifact could not be written for lack of space; nothing of it is kept for reuse."""


class MissingInputError(UserError, FileNotFoundError):
    """A file the run or the command needs is not there (a record of an earlier stage, an input file)."""


def first_line(error: BaseException) -> str:
    """An error's first line (its class name where it says nothing): what a one-line message quotes of it."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
