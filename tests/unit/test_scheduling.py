"""The order `pytest -n` hands tests out in: the longest unit first, a module's shared fixture set up by one worker,
and the durations a run stores for the next one."""

from __future__ import annotations

import contextlib
import fcntl
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tests.scheduling import DurationStore, MachineLock, known_durations, longest_first


@dataclass
class FakeItem:
    nodeid: str
    scopes: tuple[str, ...] = ("function",)
    slow: bool = False
    markers: list[Any] = field(default_factory=list)

    @property
    def keywords(self) -> set[str]:
        return {"slow"} if self.slow else set()

    @property
    def _fixtureinfo(self) -> SimpleNamespace:
        return SimpleNamespace(name2fixturedefs={f"f{i}": [SimpleNamespace(scope=scope)]
                                                 for i, scope in enumerate(self.scopes)})

    def add_marker(self, marker: Any) -> None:
        self.markers.append(marker)


def groups(item: FakeItem) -> list[str]:
    return [marker.args[0] for marker in item.markers if marker.name == "xdist_group"]


def test_the_longest_unit_goes_first_and_a_shared_fixture_keeps_its_module_together() -> None:
    shared = [FakeItem("tests/a.py::one", ("function", "module")), FakeItem("tests/a.py::two", ("module",))]
    alone = FakeItem("tests/b.py::long")
    fast = FakeItem("tests/c.py::fast", ("session",))
    new_slow = FakeItem("tests/d.py::new", slow=True)
    durations = {"tests/a.py::one": 20.0, "tests/a.py::two": 25.0, "tests/b.py::long": 40.0}
    ordered = longest_first([fast, *shared, alone, new_slow], durations)
    # module a: 45 s together, then b's 40 s, then an unlisted slow test (taken as a typical one), the fast one last
    assert [item.nodeid for item in ordered] == ["tests/a.py::one", "tests/a.py::two", "tests/b.py::long",
                                                  "tests/d.py::new", "tests/c.py::fast"]
    assert [groups(item) for item in shared] == [["tests/a.py"], ["tests/a.py"]]
    assert groups(alone) == groups(fast) == groups(new_slow) == []  # a session fixture is shared across workers


def test_a_run_stores_each_tests_seconds_without_its_group(tmp_path: Path) -> None:
    path = tmp_path / "durations.json"
    store = DurationStore(path)
    for nodeid, seconds in [("tests/a.py::one@tests/a.py", 1.2), ("tests/a.py::one@tests/a.py", 4.0),
                            ("tests/b.py::two[x@y]", 3.5), ("tests/c.py::quick", 0.5)]:
        store.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, duration=seconds))
    store.pytest_sessionfinish(SimpleNamespace())
    assert json.loads(path.read_text()) == {"tests/a.py::one": 5.2, "tests/b.py::two[x@y]": 3.5}
    assert known_durations(path) == {"tests/a.py::one": 5.2, "tests/b.py::two[x@y]": 3.5}
    assert known_durations(tmp_path / "none.json") == {}


def test_the_group_xdist_appends_to_a_node_id_is_kept(request: Any) -> None:
    """`--dist loadgroup` groups tests by the `@group` xdist's worker writes into `item._nodeid` (xdist/remote.py);
    a pytest that no longer reads that attribute (pytest 9) silently sends a module's tests to every worker, each
    setting its shared fixture up again."""
    item = request.node
    original = item.nodeid
    item._nodeid = f"{original}@probe"
    try:
        assert item.nodeid == f"{original}@probe"
    finally:
        item._nodeid = original


def run_held(folder: Path, name: str, order: list[str], end: threading.Event,
             timed: bool = False) -> threading.Thread:
    """A test process's run of a test under its lock, in a thread: it notes when its test (or the part it times
    alone) begins and ends, and ends when `end` is set."""
    lock = MachineLock(folder)  # each test process has its own

    def protocol() -> None:
        wrapper: Iterator[None] = lock.pytest_runtest_protocol(FakeItem(name), None)
        next(wrapper)
        with lock.alone() if timed else contextlib.nullcontext():
            order.append(f"{name} begins")
            end.wait(timeout=10)
            order.append(f"{name} ends")
        with contextlib.suppress(StopIteration):
            wrapper.send(None)

    thread = threading.Thread(target=protocol)
    thread.start()
    return thread


def held(path: Path) -> bool:
    with path.open("a") as file:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        return False


def wait_until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_part_timed_alone_waits_for_the_running_tests_and_the_next_ones_wait_for_it(tmp_path: Path) -> None:
    order: list[str] = []
    ends = {name: threading.Event() for name in ("running", "alone", "later")}
    threads = [run_held(tmp_path, "running", order, ends["running"])]
    wait_until(lambda: order == ["running begins"])
    threads.append(run_held(tmp_path, "alone", order, ends["alone"], timed=True))
    wait_until(lambda: held(MachineLock(tmp_path).gate))  # the timing test holds the gate, waiting for the running one
    threads.append(run_held(tmp_path, "later", order, ends["later"]))
    time.sleep(0.3)
    assert order == ["running begins"]
    ends["running"].set()
    wait_until(lambda: order[-1] == "alone begins")
    time.sleep(0.3)
    assert order == ["running begins", "running ends", "alone begins"]
    ends["alone"].set()
    ends["later"].set()
    for thread in threads:
        thread.join(timeout=10)
    assert order == ["running begins", "running ends", "alone begins", "alone ends", "later begins", "later ends"]


def test_tests_run_side_by_side_outside_alone(tmp_path: Path) -> None:
    order: list[str] = []
    end = threading.Event()
    threads = [run_held(tmp_path, name, order, end) for name in ("one", "two")]
    wait_until(lambda: len(order) == 2)
    end.set()
    for thread in threads:
        thread.join(timeout=10)
    assert sorted(order[:2]) == ["one begins", "two begins"]
