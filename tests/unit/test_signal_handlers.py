"""A stop signal that arrives while the main thread is inside a log call: the handler runs between two of that
call's bytecodes, while it holds its handler's lock. Prefect's API log handler takes a lock that is not reentrant,
so a handler that logged would wait on it for ever (a run hung for 120 s in CI, SIGTERM'd mid-log). The handlers
only note the signal; the training's step end (one process) or a watcher thread (the launcher) says so."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from transformers import TrainerControl, TrainerState

from llmops.training.callbacks import StopOnSignal
from llmops.training.launch import forwarding_signals

TRIGGER = "a line logged as the signal comes"


class LockingHandler(logging.Handler):
    """A log handler with a lock of its own that is not reentrant, as Prefect's API log handler has. The record
    TRIGGER sends SIGTERM to this process while it holds the lock; a signal handler that logs then finds it taken."""

    def __init__(self) -> None:
        super().__init__()
        self.held = threading.Lock()
        self.messages: list[str] = []
        self.blocked = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.held.acquire(timeout=3):  # for ever, in the real one
            self.blocked = True
            return
        try:
            self.messages.append(record.getMessage())
            if record.getMessage() == TRIGGER and threading.current_thread() is threading.main_thread():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.5)  # the signal's handler runs here, the lock held
        finally:
            self.held.release()


@pytest.fixture
def handler() -> Iterator[LockingHandler]:
    found = LockingHandler()
    logger = logging.getLogger("llmops")
    level = logger.level
    logger.addHandler(found)
    logger.setLevel(logging.INFO)
    try:
        yield found
    finally:
        logger.removeHandler(found)
        logger.setLevel(level)


def test_a_training_process_signalled_mid_log_stops_at_the_step_end_and_says_so_there(
        handler: LockingHandler) -> None:
    callback = StopOnSignal()
    with callback.listening((signal.SIGTERM,)):
        logging.getLogger("llmops.training.trainer").info(TRIGGER)
        assert callback.requested.is_set() and not handler.blocked
        assert "SIGTERM: stopping after this step, with a checkpoint" not in handler.messages  # not from the handler
        control = TrainerControl()
        callback.on_step_end(SimpleNamespace(world_size=1), TrainerState(global_step=3), control)
    assert control.should_training_stop and control.should_save
    assert handler.messages[-1] == "SIGTERM: stopping after this step, with a checkpoint"


WORKER = """
import signal, sys, time
signal.signal(signal.SIGINT, lambda *_: (print("asked to stop", flush=True), sys.exit(0)))
print("ready", flush=True)
time.sleep(30)
"""


def test_the_launcher_signalled_mid_log_forwards_the_stop_and_says_so_from_its_watcher(
        handler: LockingHandler) -> None:
    # a stand-in for torchrun and its worker: the launcher forwards SIGINT to the launched process's children
    launched = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; sys.exit(subprocess.call("
                                 f"[sys.executable, '-c', {WORKER!r}]))"],
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert launched.stdout is not None and launched.stdout.readline() == "ready\n"
    with forwarding_signals(launched) as forwarding:
        logging.getLogger("llmops.training.launch").info(TRIGGER)
        assert forwarding.heard == "SIGTERM" and not handler.blocked
        assert launched.stdout.readline() == "asked to stop\n"
        assert launched.wait(timeout=10) == 0
    deadline = time.monotonic() + 10
    while "SIGTERM: asking the training workers to stop after this step, with a checkpoint" not in handler.messages:
        assert time.monotonic() < deadline, handler.messages
        time.sleep(0.05)
