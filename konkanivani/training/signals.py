"""Stopping a run cleanly: why a run stops (``Stop``), signals and a time budget, and too many
skipped (non-finite) updates.

``StopRequest`` turns the first SIGINT or SIGTERM (Ctrl-C, a Colab disconnect, a preemption
notice) and the end of a ``--max_time`` budget into a request that the training loop honours
after the current optimizer step, by saving and returning. A second signal of the same kind acts
as it would have without us (Ctrl-C raises ``KeyboardInterrupt`` at once). The handlers are
installed only while the context is open, and only from the main thread, where Python allows it.
"""
from __future__ import annotations

import enum
import logging
import signal
import threading
import time
from pathlib import Path
from types import FrameType

from torch.utils.data import DataLoader

from ..checkpoint import LATEST_FILE

__all__ = [
    "NonFiniteSkips",
    "Stop",
    "StopRequest",
    "TrainingDiverged",
    "diverged_message",
    "ignore_stop_signals",
    "stop_workers",
]

log = logging.getLogger("konkanivani")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stop(enum.IntEnum):
    """Why a run stops (``NONE``: it goes on), in order of precedence: where two reasons meet (two
    processes of a data-parallel run, or a request that comes as a limit is reached) the larger is
    the run's, so that the processes agree by the largest value any of them has. The limits
    (--max_steps, a caller's ``on_step``) end a run where it was meant to end; the requests (a
    signal, the end of the --max_time budget: ``early``) end it before, saved, to be resumed."""

    NONE = 0
    MAX_STEPS = 1
    ON_STEP = 2
    SIGINT = 3
    SIGTERM = 4
    MAX_TIME = 5

    @property
    def early(self) -> bool:
        """A request to stop before the run's end: a signal or --max_time."""
        return self >= Stop.SIGINT

    @property
    def reason(self) -> str | None:
        """The name a run's summary and messages give it: ``"max_steps"``, ``"on_step"``,
        ``"SIGINT"``, ``"SIGTERM"``, ``"--max_time"``; None for ``NONE``."""
        return _REASONS[self]

    @classmethod
    def of(cls, reason: str | None) -> Stop:
        """The stop ``reason`` names (the inverse of ``reason``)."""
        return next(stop for stop in cls if stop.reason == reason)

    @property
    def exit_code(self) -> int:
        """The training CLI's exit status: 128 + the signal for a signal, as a shell reports a
        process ended by it (so that a wrapper can tell "interrupted" from "done"); 0 otherwise
        (--max_time too: the run did what it was asked and left a checkpoint to resume from)."""
        return 128 + signal.Signals[self.name] if self in (Stop.SIGINT, Stop.SIGTERM) else 0


_REASONS = {Stop.NONE: None, Stop.MAX_STEPS: "max_steps", Stop.ON_STEP: "on_step",
            Stop.SIGINT: "SIGINT", Stop.SIGTERM: "SIGTERM", Stop.MAX_TIME: "--max_time"}


class StopRequest:
    """``stop()`` is ``Stop.NONE`` until a stop was asked for, then ``Stop.SIGINT``,
    ``Stop.SIGTERM`` or ``Stop.MAX_TIME``: the first that came."""

    def __init__(self, max_time: float = 0.0):
        self.max_time = max_time  # seconds of wall clock; 0: no budget
        self._stop = Stop.NONE
        self._signalled = False
        self._start = time.monotonic()
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # The next signal of this kind gets the previous handler: a second Ctrl-C interrupts at
        # once.
        previous = self._previous.pop(signum, None)
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        if not self._stop:
            self._stop, self._signalled = Stop[signal.Signals(signum).name], True
            log.warning("%s received: finishing the current step, then saving and stopping "
                        "(send it again to stop at once)", self._stop.reason)

    def stop(self) -> Stop:
        if not self._stop and self.max_time > 0 and time.monotonic() - self._start >= self.max_time:
            self._stop = Stop.MAX_TIME
        return self._stop

    def signalled(self) -> Stop:
        """The signal that asked the run to stop, if one did first (``Stop.NONE`` otherwise): read
        without the clock."""
        return self._stop if self._signalled else Stop.NONE


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: a Ctrl-C reaches the whole process group; the workers must
    keep serving batches while the main process finishes its step. So they must be stopped with
    ``stop_workers``: they ignore the SIGTERM that ends daemon processes at the interpreter's exit,
    which would wait for them for ever."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def stop_workers(loader: DataLoader) -> None:
    """End a DataLoader's persistent workers now, not when the loader happens to be collected: a
    training run called in a longer-lived process (a test suite, a notebook) could otherwise leave
    them to the interpreter's exit, which then hangs (see ``ignore_stop_signals``)."""
    # where persistent workers live
    iterator, loader._iterator = getattr(loader, "_iterator", None), None
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


class TrainingDiverged(RuntimeError):
    """Too many updates in a row were skipped for a non-finite loss or gradients."""


def diverged_message(in_a_row: int, step: int, out_dir: Path, fp16: bool) -> str:
    advice = (
        "with fp16 the gradients overflowed every time: go on in bf16 or fp32 (--precision bf16 or "
        "--precision fp32; --no_mixed_precision trains in fp32)"
        if fp16
        else "lower --lr or --grad_clip, and check the utterances named above"
    )
    return (
        f"{in_a_row} updates in a row were skipped for a non-finite loss or gradients (steps"
        f" {step - in_a_row + 1} to {step}), so training stopped. The weights are those of step"
        f" {step - in_a_row}, saved in {out_dir / LATEST_FILE}; {advice}, then resume with --resume"
        " latest."
    )


class NonFiniteSkips:
    """Counts updates skipped for a non-finite loss or gradient norm, in a row and in all."""

    def __init__(self, limit: int):
        self.limit = limit  # stop after this many in a row; 0: never
        self.in_a_row = 0
        self.total = 0

    def update(self, finite: bool) -> bool:
        """Record one update; True when the run should stop (``exceeded``)."""
        if finite:
            self.in_a_row = 0
        else:
            self.in_a_row += 1
            self.total += 1
        return self.exceeded

    @property
    def exceeded(self) -> bool:
        return 0 < self.limit <= self.in_a_row
