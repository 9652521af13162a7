"""The order `pytest -n` hands tests out in: the longest first, so that none of them starts last and runs alone.

With `--dist loadgroup` xdist gives a free worker the next test (or group) in collection order. Tests that share a
module-scoped fixture form one group, so that one worker sets the fixture up once. Each test's seconds come from
tests/durations.json, which `pytest --store-durations` rewrites after a full run; a test it does not list counts
as a typical slow or fast one.

A test that times what a machine owes (a killed replica replaced within 30 s) times it `alone`: under `pytest -n`
that part runs once the other processes' tests have ended, and they wait for it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

DURATIONS = Path(__file__).with_name("durations.json")
# what a test durations.json does not list is taken to need (seconds): a new slow test is most often a whole run
UNLISTED_SLOW, UNLISTED_FAST = 30.0, 0.2
# below this a test's duration is not worth keeping: it only orders the tail
KEPT_SECONDS = 3.0
SHARED_SCOPES = ("class", "module", "package")
# the folder of a `pytest -n` run's locks, which its first process makes and its test processes inherit
LOCKS = "LLMOPS_TEST_LOCKS"


def known_durations(path: Path = DURATIONS) -> dict[str, float]:
    return json.loads(path.read_text()) if path.is_file() else {}


def shares_a_fixture(item: pytest.Item) -> bool:
    """Whether the test uses a fixture set up once for its module (or class, or package)."""
    info = getattr(item, "_fixtureinfo", None)
    definitions = info.name2fixturedefs.values() if info else []
    return any(definition.scope in SHARED_SCOPES for chain in definitions for definition in chain)


def unit_of(item: pytest.Item) -> str:
    """What xdist hands out whole: the test's module when it shares a fixture with its neighbours, else the test."""
    return item.nodeid.split("::")[0] if shares_a_fixture(item) else item.nodeid


def longest_first(items: list[pytest.Item], durations: dict[str, float]) -> list[pytest.Item]:
    """The items by unit, the longest unit first (by the seconds in `durations`); within a unit the collection's
    order. Marks the shared-fixture groups for `--dist loadgroup`."""
    units: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        unit = unit_of(item)
        if unit != item.nodeid:
            item.add_marker(pytest.mark.xdist_group(unit))
        units[unit].append(item)

    def seconds(item: pytest.Item) -> float:
        return durations.get(item.nodeid, UNLISTED_SLOW if "slow" in item.keywords else UNLISTED_FAST)

    ordered = sorted(units.values(), key=lambda unit: -sum(seconds(item) for item in unit))
    return [item for unit in ordered for item in unit]


class DurationStore:
    """`--store-durations`: each test's seconds (setup, call and teardown) from this run, written when it ends."""

    def __init__(self, path: Path = DURATIONS) -> None:
        self.path = path
        self.seconds: dict[str, float] = defaultdict(float)

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # a grouped test's id ends in "@" and its group, which longest_first names by the test's module
        self.seconds[report.nodeid.removesuffix("@" + report.nodeid.split("::")[0])] += report.duration

    @pytest.hookimpl
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        kept = {name: round(value, 1) for name, value in sorted(self.seconds.items()) if value >= KEPT_SECONDS}
        self.path.write_text(json.dumps(kept, indent=0) + "\n")


class MachineLock:
    """Under `pytest -n`: every test holds a shared lock while it runs (setup and teardown too), and a test takes it
    exclusively for what it times (`alone`). A second lock, the gate, keeps tests from starting while one waits
    for the running ones to end, so that tests that keep taking the shared lock do not starve it."""

    def __init__(self, folder: Path) -> None:
        self.gate = folder / "gate"
        self.machine = folder / "machine"
        self.held: tuple[IO[str], IO[str]] | None = None

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
        with self.gate.open("a") as gate, self.machine.open("a") as machine:
            fcntl.flock(gate, fcntl.LOCK_EX)
            fcntl.flock(machine, fcntl.LOCK_SH)
            fcntl.flock(gate, fcntl.LOCK_UN)
            self.held = gate, machine
            try:
                return (yield)
            finally:
                self.held = None  # the files' closing releases the lock

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        """Within: no other test runs. It waits for the running ones to end, and tests that start wait for it."""
        assert self.held, "alone() is for use within a test"
        gate, machine = self.held
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(machine, fcntl.LOCK_EX)  # from this test's shared lock; no one else takes it past the gate
        try:
            yield
        finally:
            fcntl.flock(machine, fcntl.LOCK_SH)
            fcntl.flock(gate, fcntl.LOCK_UN)


def machine_lock(config: pytest.Config) -> MachineLock | None:
    """In a `pytest -n` run's test process, the run's lock; in its first process, its folder, made for the run's
    test processes to find (they start after this) and removed when the run ends; in a run of one process, none."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return MachineLock(Path(os.environ[LOCKS])) if LOCKS in os.environ else None
    if config.getoption("numprocesses", None):
        folder = os.environ[LOCKS] = tempfile.mkdtemp(prefix="llmops-test-locks-")
        config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
    return None
