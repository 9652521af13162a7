"""Trainer callbacks: live figures, the sample ledger, complete checkpoints, and a clean stop on a signal."""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from llmops.pipeline.engine import peak_rss_kib
from llmops.tracking.log import RunHandle, log_metrics, metric_name, numeric
from llmops.training import checkpoints

log = logging.getLogger("llmops.train")


def peak_memory_mb() -> float:
    """Peak GPU memory allocated, or the process's peak resident memory on CPU."""
    import torch

    if torch.cuda.is_available():
        return round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return round(peak_rss_kib() / 1024, 1)


class MetricsCallback(TrainerCallback):
    """Logs loss, eval loss, learning rate, grad norm, real (non-pad) tokens/s and padding as training goes.

    A resumed training first logs the history its checkpoint carries, so the run's curves cover the whole
    training, not only the steps after the resume. Only the first process logs.
    """

    def __init__(self, run: RunHandle | None, prefix: str, padding: Any = None) -> None:
        self.run, self.prefix, self.padding = run, prefix, padding
        self.last_tokens, self.last_time = 0, time.perf_counter()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.last_tokens, self.last_time = state.num_input_tokens_seen, time.perf_counter()
        if state.global_step and state.is_world_process_zero:
            for entry in state.log_history:
                self.send(numeric(entry), int(entry.get("step", 0)))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # the history covers every step: the last steps are logged, and so is every checkpointed step, so that a
        # training resumed from a checkpoint carries the loss of every step before it
        saving = args.save_strategy == "steps" and state.global_step % max(int(args.save_steps), 1) == 0
        if state.global_step >= state.max_steps or saving:
            control.should_log = True

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        values = numeric(logs or {})
        now = time.perf_counter()
        if "loss" in values and state.num_input_tokens_seen and now > self.last_time:
            values["tokens_per_s"] = (state.num_input_tokens_seen - self.last_tokens) / (now - self.last_time)
            self.last_tokens, self.last_time = state.num_input_tokens_seen, now
        if "loss" in values and self.padding is not None:
            values["padding_fraction"] = self.padding.padding_fraction()
            values["peak_memory_mb"] = peak_memory_mb()
        if "loss" in values:
            log.info("step %d/%d  loss %.4f  %.0f tokens/s", state.global_step, state.max_steps, values["loss"],
                     values.get("tokens_per_s", 0.0))
        self.send(values, state.global_step)

    def send(self, values: dict[str, float], step: int) -> None:
        if self.run is not None and values:
            log_metrics(self.run.tracking, self.run.run_id, {metric_name(self.prefix, k): v for k, v in values.items()},
                        step=step)


class ThroughputCallback(TrainerCallback):
    """Counts the real tokens trained on and times the steady state: from the end of the first steps (warm-up,
    compilation) to the end of training.

    Nothing here waits for the GPU at every step: tokens are counted on the host (the tally of the batches trained
    on, training/tally.py, from the figures the collator put in each batch), summed over the processes only where a
    figure is read (a log, a checkpoint, an evaluation, the marks of the clock, the end), and the clock synchronises
    with the GPU at its two marks only.
    """

    def __init__(self, skip_steps: int, meter: Any = None) -> None:
        self.skip_steps, self.meter = skip_steps, meter
        self.start: tuple[float, int] | None = None
        self.end: tuple[float, int] | None = None
        self.counted = self.unsummed = 0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.first_step = state.global_step
        self.counted = self.used_tokens()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        starting = state.global_step == self.first_step + self.skip_steps
        reading = (control.should_log or control.should_save or control.should_evaluate
                   or control.should_training_stop or state.global_step >= state.max_steps)
        self.count(args, state, summing=starting or reading)
        if starting:
            self.start = (synchronized_clock(), int(state.num_input_tokens_seen))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.count(args, state, summing=True)
        self.end = (synchronized_clock(), int(state.num_input_tokens_seen))

    def used_tokens(self) -> int:
        return int(getattr(self.meter, "used_tokens", 0))

    def count(self, args: Any, state: Any, summing: bool) -> None:
        """Add this step's tokens to the state's count: at once with one process, summed over all at a reading (every
        process reaches the same readings: they follow the step count and agreed stops)."""
        used = self.used_tokens()
        self.unsummed += used - self.counted
        self.counted = used
        if args.world_size > 1 and not summing:
            return
        state.num_input_tokens_seen += summed(self.unsummed, args) if args.world_size > 1 else self.unsummed
        self.unsummed = 0

    def rate(self) -> tuple[int, float] | None:
        """(tokens, seconds) over the steady part of this run, or None when it was too short to have one."""
        if self.start is None or self.end is None or self.end[0] <= self.start[0]:
            return None
        return self.end[1] - self.start[1], self.end[0] - self.start[0]


def summed(tokens: int, args: Any) -> int:
    import torch
    from accelerate.utils import reduce

    return int(reduce(torch.tensor([tokens], device=args.device), reduction="sum").item())


def synchronized_clock() -> float:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()  # queued GPU work belongs to the steps already counted
    return time.perf_counter()


class LedgerCallback(TrainerCallback):
    """Writes, for every optimizer step, the id of every sample this process trained on in it.

    Each batch carries its sample ids from the collator (which may run in a loader worker), and the tally
    (training/tally.py) keeps them as the Trainer draws the batches of a step, in order: each micro-step takes the
    oldest batch drawn and not yet taken.
    """

    def __init__(self, meter: Any, path: Path) -> None:
        self.meter, self.path = meter, path
        self.micro_steps = 0

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.micro_steps += 1

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        batches = [self.meter.take_ids() for _ in range(self.micro_steps + 1)]
        self.micro_steps = 0
        entry = {"step": state.global_step, "epoch": round(float(state.epoch or 0), 6),
                 "samples": [sample for batch in batches for sample in batch]}
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(entry) + "\n")


def trim_ledger(folder: Path, step: int) -> None:
    """Forget ledger entries after `step`: a resumed training redoes those steps."""
    for path in sorted(folder.glob("rank-*.jsonl")):
        kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        path.write_text("".join(f"{line}\n" for line in kept))


class CheckpointCallback(TrainerCallback):
    """Marks each checkpoint complete once every process has written its part, and copies it to the store."""

    def __init__(self, store: str | None, key: str) -> None:
        self.store, self.key = store, key

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from accelerate import PartialState

        PartialState().wait_for_everyone()  # each process saves its own RNG state into the checkpoint
        # each machine that keeps its own checkpoints (save_on_each_node) marks its own complete; all of them add
        # their parts to the store's copy
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if args.should_save:
            checkpoints.write_manifest(folder)
        if self.store:
            checkpoints.publish(folder, self.store, self.key, args.should_save, state.is_world_process_zero)
        PartialState().wait_for_everyone()


class StopOnSignal(TrainerCallback):
    """On SIGINT or SIGTERM, finish the current step, save a checkpoint and stop: the training stays resumable.

    One process reads its own flag at every step. Several agree on the step to stop at every `every` steps only:
    agreeing is an all-reduce, which waits for the GPU's queued work (a host sync on the hot path)."""

    def __init__(self, every: int = 10) -> None:
        self.requested = threading.Event()
        self.heard: str | None = None  # the signal, until said
        self.every = max(1, every)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.heard:
            log.warning("%s: stopping after this step, with a checkpoint", self.heard)
            self.heard = None
        if (args.world_size <= 1 or state.global_step % self.every == 0) and self.agreed(args):
            control.should_save = control.should_log = True
            control.should_training_stop = True

    def agreed(self, args: Any) -> bool:
        """Whether any process was asked to stop: all processes must stop at the same step."""
        if args.world_size <= 1:
            return self.requested.is_set()
        import torch
        from accelerate.utils import reduce

        flag = torch.tensor([1.0 if self.requested.is_set() else 0.0], device=args.device)
        return bool(reduce(flag, reduction="sum").item() > 0)

    @contextmanager
    def listening(self, signals: tuple[int, ...]) -> Iterator[None]:
        """Catch the signals while training (main thread only); a second signal interrupts at once."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.getsignal(sig) for sig in signals}

        def request(signum: int, frame: Any) -> None:
            # the step's end says so: a handler runs between two bytecodes of whatever the main thread was doing,
            # logging too, and a log call here would wait for ever on the lock that interrupted call holds
            # (Prefect's API log handler takes one that is not reentrant)
            if self.requested.is_set():
                raise KeyboardInterrupt
            self.heard = signal.Signals(signum).name
            self.requested.set()

        for sig in previous:
            signal.signal(sig, request)
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
