"""Runs a stage's shards in parallel: a process pool on this machine (engine local) or a Ray Data map on a Ray
cluster (engine ray).

Results come back in the order of the jobs, whatever order they finish in, so a stage that combines
them writes the same bytes on either engine and with any number of workers. A job reads and writes
files by path: on a Ray cluster of several machines the workspace must be a filesystem they share.
Ray is imported only when the engine is ray.
"""

from __future__ import annotations

import logging
import os
import pickle
import resource
import socket
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from multiprocessing.context import BaseContext
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from llmops.config.engine import EngineConfig
from llmops.io.errors import ConfigError, UserError
from llmops.store.settings import mask

log = logging.getLogger("llmops.engine")

Job = TypeVar("Job")
Result = TypeVar("Result")
# a shard whose Ray worker died (killed, out of memory, its node lost) is run again this often; jobs write only
# their own files, so a rerun replaces what a dead one left. An error the job raises is not retried.
RAY_RETRIES = 3
# seconds between two progress lines of one map
PROGRESS_EVERY = 5.0


def measured(work: Callable[[Job], Result], job: Job) -> tuple[Result, int]:
    """The job's result and the peak memory (KiB) of the process that ran it."""
    result = work(job)
    return result, peak_rss_kib()


def peak_rss_kib() -> int:
    """This process's peak resident memory. Linux's VmHWM starts afresh at exec; ru_maxrss carries the size of the
    process that forked this one (a big test runner or benchmark, say) across the exec."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // (1024 if sys.platform == "darwin" else 1)


class Progress:
    """Shards done out of the total, and rows per second, logged as shards finish."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done, self.rows = label, total, 0, 0
        self.started = self.last = time.perf_counter()

    def advance(self, rows: int) -> None:
        self.done += 1
        self.rows += rows
        now = time.perf_counter()
        if now - self.last >= PROGRESS_EVERY or self.done == self.total:
            self.last = now
            took = now - self.started
            log.info("%s: %d/%d shards, %.0f rows/s%s", self.label, self.done, self.total, self.rows / max(took, 1e-9),
                     f" in {took:.2f} s" if self.done == self.total else "")


# what every stage's workers import: the fork server imports them once, when it starts, and each worker of every
# later stage starts with them (a stage of two workers here: 0.57 s to its first results without, 0.17 s with);
# great-expectations (about 4.6 s) is left out, since the server would make the first stage wait for it and only
# validate uses it
PRELOAD = ("numpy", "pyarrow", "pyarrow.compute", "pandas", "rensa")


def forkserver() -> BaseContext:
    """The fork-server context, with PRELOAD (which takes effect where the server has not started yet; a module
    that fails to import is skipped by the server, and imported by the worker that needs it)."""
    context = get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    return context


class Engine:
    """Maps a function over jobs on the configured engine; keeps what the stage logs: shards, workers, peak memory."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.shards = 0
        self.peak_kib = 0
        self.pool: Executor | None = None
        self.workers = self.start()

    def start(self) -> int:
        if self.config.name == "ray":
            return start_ray(self.config)
        workers = self.config.processes_here()
        if workers < self.config.local_workers():
            log.warning("engine.workers %d: this machine has %d usable CPUs, so %d worker processes run",
                        self.config.local_workers(), workers, workers)
        if workers > 1:
            # a fresh interpreter per worker: forking a process that holds threads (a flow's) is unsafe
            self.pool = ProcessPoolExecutor(max_workers=workers, mp_context=forkserver())
        return workers

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)

    def map(self, label: str, work: Callable[[Job], Result], jobs: Sequence[Job],
            rows: Callable[[Result], int] = lambda _: 0) -> list[Result]:
        """work(job) for each job, in the order of `jobs`."""
        progress = Progress(label, len(jobs))
        if self.config.name == "ray":
            done = on_ray(work, jobs, progress, rows, self.workers)
        elif self.pool is None or len(jobs) < 2:
            done = []
            for job in jobs:
                done.append(measured(work, job))
                progress.advance(rows(done[-1][0]))
        else:
            done = in_pool(self.pool, work, jobs, progress, rows)
        self.shards += len(jobs)
        self.peak_kib = max([self.peak_kib, *(peak for _, peak in done)])
        return [result for result, _ in done]

    def figures(self) -> dict[str, Any]:
        return {"shards": self.shards, "workers": self.workers, "peak_worker_rss_mb": round(self.peak_kib / 1024, 1)}


def in_pool(pool: Executor, work: Callable[[Job], Result], jobs: Sequence[Job], progress: Progress,
            rows: Callable[[Result], int]) -> list[tuple[Result, int]]:
    futures = {pool.submit(measured, work, job): index for index, job in enumerate(jobs)}
    return in_order(((futures[future], future.result()) for future in as_completed(futures)), len(jobs), progress,
                    rows)


def in_order(finished: Iterable[tuple[int, tuple[Result, int]]], count: int, progress: Progress,
             rows: Callable[[Result], int]) -> list[tuple[Result, int]]:
    """Results as they finish, each with its job's index, put back in the order of the jobs; a job that comes
    back twice or never is an error, not a row more or less."""
    done: dict[int, tuple[Result, int]] = {}
    for index, outcome in finished:
        if index in done:
            raise RuntimeError(f"{progress.label}: shard {index} came back twice")
        done[index] = outcome
        progress.advance(rows(outcome[0]))
    missing = [index for index in range(count) if index not in done]
    if missing:
        raise RuntimeError(f"{progress.label}: shards {missing[:5]} never came back")
    return [done[index] for index in range(count)]


def start_ray(config: EngineConfig) -> int:
    """Join the configured cluster (or RAY_ADDRESS), or start a local one; the number of CPUs that work."""
    ray = ray_module()
    if not ray.is_initialized():
        address = config.ray_address()
        # "local" starts a cluster of this run's own, even where another one runs on the machine
        local = {} if address else {"address": "local", "num_cpus": config.processes_here(), "include_dashboard": False}
        if address:
            refuse_address(address)
        try:
            # Ray's own lines at Ray Data's level (RAY_DATA_LOG_LEVEL: the CLI's ERROR unless --verbose)
            # (logging_level: the "ray" logger only; a LoggingConfig would take over the root logger)
            ray.init(**({"address": address} if address else local), log_to_driver=False,
                     logging_level=os.environ.get("RAY_DATA_LOG_LEVEL", "INFO"))
        except (ConnectionError, RuntimeError, ValueError) as err:
            where = mask(address) if address else "a local cluster"
            raise ConfigError(f"engine: ray: cannot start or join {where}: {' '.join(str(err).split())[:300]}") from err
        log.info("engine ray: %s", mask(address) if address else "a local cluster")
    cpus = int(ray.cluster_resources().get("CPU", 1))
    return min(config.workers or cpus, cpus)


def refuse_address(address: str, timeout: float = 10.0) -> None:
    """A cluster address the stages cannot work through, as one line before Ray tries it. Ray Client (ray://) runs
    no Ray Data or Ray Train driver from outside the cluster; and Ray retries a host:port where nothing answers for
    minutes, so a typo would look like a hang. Other forms (auto) are Ray's to read."""
    if address.startswith("ray://"):
        raise ConfigError(f"engine: ray: {mask(address)} is a Ray Client address, which cannot drive Ray Data or Ray "
                          "Train; give the cluster's own address (host:6379) on one of its machines, or submit the "
                          "run there: ray job submit -- llmops run ...")
    host, colon, port = address.rpartition(":")
    if not colon or not port.isdigit() or "/" in host:
        return
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout):
            return
    except OSError as err:
        why = err.strerror or type(err).__name__
    raise ConfigError(f"engine: ray: nothing answers at {mask(address)} ({why}); start the cluster there (ray start "
                      "--head) or correct engine.address / RAY_ADDRESS")


def ray_module() -> Any:
    """Ray, or one line saying how to install it: it is an optional extra."""
    try:
        import ray
    except ImportError as err:
        raise ConfigError("engine: ray needs Ray: pip install 'llmops[ray]' (or set engine: local)") from err
    return ray


def on_ray(work: Callable[[Job], Result], jobs: Sequence[Job], progress: Progress,
           rows: Callable[[Result], int], workers: int) -> list[tuple[Result, int]]:
    """The jobs as a Ray Data dataset of (index, job) rows, one block each, mapped by at most `workers` tasks at once
    (engine.workers bounds memory on a cluster too); results streamed back as they finish, then put in job order."""
    if not jobs:
        return []
    ray = ray_module()
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # progress is ours: shards and rows/s in the log
    items = [{"index": index, "job": pickle.dumps(job)} for index, job in enumerate(jobs)]
    dataset = ray.data.from_items(items, override_num_blocks=len(items))
    with warnings.catch_warnings():
        # Ray Data takes task retry settings as remote args only, which it has marked as going away
        warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")
        mapped = dataset.map(run_row, fn_kwargs={"work": work}, compute=ray.data.TaskPoolStrategy(size=max(1, workers)),
                             num_cpus=1, max_retries=RAY_RETRIES, retry_exceptions=False)
    finished = (finished_row(row) for row in mapped.iter_rows())
    return in_order(finished, len(jobs), progress, rows)


def run_row(row: dict[str, Any], work: Callable[[Job], Result]) -> dict[str, Any]:
    """One (index, job) row of the dataset to its (index, outcome, error) row, pickled so the result keeps its types.
    A user error comes back as a row: Ray Data would keep only its traceback, and the CLI says it in one line."""
    try:
        outcome, error = pickle.dumps(measured(work, pickle.loads(row["job"]))), b""
    except UserError as err:
        outcome, error = b"", pickle.dumps(err)
    return {"index": row["index"], "outcome": outcome, "error": error}


def finished_row(row: dict[str, Any]) -> tuple[int, Any]:
    if row["error"]:
        raise pickle.loads(row["error"])
    return row["index"], pickle.loads(row["outcome"])
