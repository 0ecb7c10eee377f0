"""Stopping a run cleanly: signals and a time budget, and too many skipped (non-finite) updates.

``StopRequest`` turns the first SIGINT or SIGTERM (Ctrl-C, a Colab disconnect, a preemption
notice) and the end of a ``--max_time`` budget into a request that the training loop honours
after the current optimizer step, by saving and returning. A second signal of the same kind acts
as it would have without us (Ctrl-C raises ``KeyboardInterrupt`` at once). The handlers are
installed only while the context is open, and only from the main thread, where Python allows it.
"""
from __future__ import annotations

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
    "StopRequest",
    "TrainingDiverged",
    "diverged_message",
    "ignore_stop_signals",
    "stop_workers",
]

log = logging.getLogger("konkanivani")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """``reason()`` is None until a stop was asked for, then ``"SIGINT"``, ``"SIGTERM"`` or
    ``"--max_time"``."""

    def __init__(self, max_time: float = 0.0):
        self.max_time = max_time  # seconds of wall clock; 0: no budget
        self.signum: int | None = None
        self._reason: str | None = None
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
        if self._reason is None:
            self.signum, self._reason = signum, signal.Signals(signum).name
            log.warning("%s received: finishing the current step, then saving and stopping "
                        "(send it again to stop at once)", self._reason)

    def reason(self) -> str | None:
        if (
            self._reason is None
            and self.max_time > 0
            and time.monotonic() - self._start >= self.max_time
        ):
            self._reason = "--max_time"
        return self._reason

    def elapsed(self) -> float:
        return time.monotonic() - self._start


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
