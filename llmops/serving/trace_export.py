"""The replica's trace writer: finished traces go to the tracking store in batches, from a thread of its own.

MLflow's own exporter writes each trace in two transactions (its spans, then its info), some 20 ms
of CPU a trace on a SQLite store: on a small machine that, not the model, bounded a traced service.
Here a request only appends its record to a bounded buffer; the writer hands up to `BATCH` of them
at a time to the replica's store process (serving/trace_store.py), which writes them through the
store's span ingestion (`log_spans`, the OTLP path the MLflow server takes too): each trace is
created from its root span, in one transaction for the whole batch (about 2 ms a trace, measured),
and none of that holds the replica's interpreter lock. The traces are complete MLflow traces:
`search_traces`, the UI and assessments read them as any other.

A store that does not answer never reaches a request: the writer keeps what it holds and tries
again with a growing pause, says so once when the store goes away and once when it is back. What
overflows the buffer (the oldest first) and what the store refuses outright are counted in
`llmops_traces_dropped_total`, never lost silently.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from typing import Any

from llmops.serving.trace_store import Outcome, Record, StoreProcess

log = logging.getLogger("llmops.serve")
# traces written in one transaction; and how long a partial batch waits for more
BATCH = 64
GATHER_SECONDS = 0.2
# traces kept while the store does not answer, at most so many and so many bytes of their text (a few KiB each,
# but a body may reach the service's 1 MiB limit): past either the oldest go, counted
CAPACITY = 20_000
CAPACITY_BYTES = 128 << 20
# tries of a batch the store refuses while it answers, then it is dropped and counted
TRIES = 3
RETRY_SECONDS = 0.5
LONGEST_PAUSE = 30.0


class TraceWriter:
    """Writes records to one experiment of a tracking store in batches (see the module's docstring)."""

    def __init__(self, tracking_uri: str, experiment: str, dropped: Any, queued: Any) -> None:
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.dropped = dropped
        self.queued = queued
        self.held: deque[Record] = deque()
        self.held_bytes = 0
        self.changed = threading.Condition()
        # records taken in, and those done with (written or dropped): a flush waits for those before it only
        self.taken_in = 0
        self.done = 0
        self.hurrying = 0  # flushes waiting: a partial batch goes at once
        self.down = False
        self.closed = False
        self.thread: threading.Thread | None = None
        self.in_flight: list[Record] = []  # the batch the store process is writing
        self.store = StoreProcess(tracking_uri, experiment)
        self.store.start()

    def put(self, record: Record) -> None:
        record.size = record_bytes(record)  # outside the lock: the writer's thread waits for nothing of it
        with self.changed:
            if self.closed:
                self.lose(1)
                return
            while self.held and not self.fits(record.size):
                self.lose(len(self.take(1)))
            self.held.append(record)
            self.held_bytes += record.size
            self.taken_in += 1
            self.queued.set(len(self.held))
            if self.thread is None or not self.thread.is_alive():  # started by the first trace
                self.thread = threading.Thread(target=self.run, name="llmops-trace-writer", daemon=True)
                self.thread.start()
            if len(self.held) >= BATCH:
                self.changed.notify_all()

    def fits(self, size: int) -> bool:
        """Whether one more record of `size` bytes stays within the buffer's bounds (the caller holds the lock)."""
        return len(self.held) < CAPACITY and self.held_bytes + size <= CAPACITY_BYTES

    def take(self, count: int) -> list[Record]:
        """The `count` oldest records held, taken out (the caller holds the lock)."""
        taken = [self.held.popleft() for _ in range(min(count, len(self.held)))]
        self.held_bytes -= sum(record.size for record in taken)
        return taken

    def put_back(self, taken: list[Record]) -> None:
        """A batch the store did not take goes back in front, in its order: as many of its newest as fit, the rest
        dropped and counted (the caller holds the lock)."""
        kept = 0
        while kept < len(taken) and self.fits(taken[len(taken) - 1 - kept].size):
            record = taken[len(taken) - 1 - kept]
            self.held.appendleft(record)
            self.held_bytes += record.size
            kept += 1
        self.lose(len(taken) - kept)

    def lose(self, count: int) -> None:
        """Count records dropped (the caller holds the lock)."""
        if count:
            self.dropped.inc(count)
            self.done += count

    def holds(self, trace_id: str) -> bool:
        """Whether a record of this id is taken in and not yet written (held, or in the batch being written)."""
        with self.changed:
            return any(record.trace_id == trace_id for record in (*self.held, *self.in_flight))

    def flush(self, seconds: float) -> int:
        """Write the records taken in before this call, waiting at most `seconds`: how many of them are left."""
        deadline = time.monotonic() + seconds
        with self.changed:
            target = self.taken_in
            self.hurrying += 1
            self.changed.notify_all()
            try:
                while self.done < target and time.monotonic() < deadline:
                    self.changed.wait(timeout=min(0.1, max(0.0, deadline - time.monotonic())))
            finally:
                self.hurrying -= 1
            return max(0, target - self.done)

    def close(self, seconds: float) -> int:
        """Write what is held, waiting at most `seconds` (the replica is stopping); what is left is dropped, counted,
        and so is a batch in flight that the store then does not take: the number dropped here."""
        self.flush(seconds)
        with self.changed:
            self.closed = True
            left = len(self.take(len(self.held)))
            self.lose(left)
            self.queued.set(0)
        self.store.close()
        return left

    def run(self) -> None:
        pause = 0.0
        while True:
            try:
                pause = self.step(pause)
            except Exception:  # a defect here must not end tracing for the replica's life: said, then go on
                log.exception("the trace writer failed; it goes on")
                pause = 1.0

    def step(self, pause: float) -> float:
        """One batch: gathered, written or put back; the pause before the next."""
        with self.changed:
            # a full batch, or a flush waiting, goes at once; while the store is away the pause holds (a flush
            # shortens it to a second)
            self.changed.wait_for(lambda: (len(self.held) >= BATCH or self.hurrying > 0) and not self.down,
                                  timeout=GATHER_SECONDS + (min(pause, 1.0) if self.hurrying else pause))
            taken = self.in_flight = self.take(BATCH)
        written = self.write(taken) if taken else True
        with self.changed:
            self.in_flight = []
            if written:
                self.done += len(taken)
            elif self.closed:  # the replica is stopping: nothing will try again
                self.lose(len(taken))
            else:  # the store is away: it tries again later
                self.put_back(taken)
            self.queued.set(len(self.held))
            self.changed.notify_all()
        return 0.0 if written else min(LONGEST_PAUSE, max(1.0, 2 * pause))

    def write(self, records: list[Record]) -> bool:
        """Whether the batch is done with: written, or refused by a store that answers (then counted as dropped).
        Records that cannot be made spans are dropped and counted on the way, and taken out of `records`."""
        for attempt in range(TRIES):
            outcome = self.store.write(records)
            self.leave_out(records, outcome)
            if outcome.status == "written":
                if self.down:
                    self.down = False
                    log.warning("the tracking store answers again: the traces kept meanwhile are being written")
                return True
            if outcome.status == "down":
                return self.went_away(outcome.failure)
            if attempt + 1 == TRIES:
                log.warning("the tracking store refused %d traces: %s", len(records), outcome.failure)
                self.dropped.inc(len(records))  # done with: the caller counts them so, with the batch
                return True
            time.sleep(RETRY_SECONDS * (attempt + 1))
        return True

    def leave_out(self, records: list[Record], outcome: Outcome) -> None:
        """Drop, count and say the records that cannot be made spans (their values), alone: the rest of the batch is
        kept, and goes back to the buffer if the store is away."""
        unmade = dict(outcome.unmade)
        if not unmade:
            return
        for trace_id, why in unmade.items():
            log.warning("trace %s not written: %s", trace_id, why)
        kept = [record for record in records if record.trace_id not in unmade]
        with self.changed:
            self.lose(len(records) - len(kept))
        records[:] = kept

    def went_away(self, failure: str) -> bool:
        if not self.down:
            self.down = True
            log.warning("the tracking store does not answer (%s): traces are kept, at most %d (%d MiB), until it does",
                        failure, CAPACITY, CAPACITY_BYTES >> 20)
        return False


def record_bytes(record: Record) -> int:
    """About what a record holds in memory: the size of its text as JSON."""
    return len(json.dumps([record.inputs, record.outputs, record.error], default=str, ensure_ascii=False))
