"""``RUN_DIR/tensorboard/``: the rows of ``metrics.jsonl`` as TensorBoard scalars, for
``tensorboard --logdir RUN_DIR``.

Each figure of a row becomes the scalar ``KIND/NAME`` at the row's step (``train/loss``,
``train/lr``, ``valid/cer``, ...). TensorBoard is optional (``pip install
"konkanivani[tensorboard]"``): without it a run logs one line saying so and writes no event files.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Optional

__all__ = ["TensorBoardLog", "open_tensorboard"]

log = logging.getLogger("konkanivani")


class TensorBoardLog:
    """Scalars to a ``SummaryWriter``; with none (TensorBoard off, not installed, not rank 0) every
    call does nothing."""

    def __init__(self, writer: Optional[Any] = None):
        self.writer = writer

    def write(self, kind: str, step: int, **values: Optional[float]) -> None:
        if self.writer is None:
            return
        for name, value in values.items():
            # as metrics.jsonl: a non-finite figure is left out
            if value is not None and math.isfinite(value):
                self.writer.add_scalar(f"{kind}/{name}", value, step)
        if kind == "valid":  # validations are rare: show each one at once, not at the next flush
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def open_tensorboard(log_dir: str | Path, start_step: int) -> TensorBoardLog:
    """A log in ``log_dir`` for a run that goes on from ``start_step`` (0 for a fresh run).

    Events an earlier run in the directory wrote past ``start_step`` (it died after its last
    save) are hidden from TensorBoard (``purge_step``), as ``metrics.jsonl`` drops their rows:
    no step is shown twice.
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.info(
            "TensorBoard is not installed: no event files in %s (pip install"
            ' "konkanivani[tensorboard]", or --no_tensorboard to leave them out)',
            log_dir,
        )
        return TensorBoardLog()
    return TensorBoardLog(SummaryWriter(str(log_dir), purge_step=start_step + 1, flush_secs=30))
