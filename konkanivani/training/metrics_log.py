"""``RUN_DIR/metrics.jsonl``, the run's figures one JSON object a line: written by the training
loops (``MetricsLog``), read back by the curves, the benchmarks and ``konkanivani-plot``
(``read_metrics``). One writer, one reader."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from ..checkpoint import CheckpointError

__all__ = ["MetricsLog", "Rows", "read_metrics"]

Rows = dict[str, list[dict[str, Any]]]  # kind ("train", "valid") -> its rows, by step


class MetricsLog:
    """``OUTPUT_DIR/metrics.jsonl``: one JSON object a line (``kind``, ``step``, ``epoch`` and the
    figures)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def write(self, kind: str, step: int, epoch: int, **values: float) -> None:
        # strict JSON: no NaN
        values = {k: v if math.isfinite(v) else None for k, v in values.items()}
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"kind": kind, "step": step, "epoch": epoch, **values}) + "\n")
        except OSError as e:  # a full disk, say: one line naming the file, not a traceback
            raise CheckpointError(f"could not write {self.path}: {e.strerror or e}") from e

    def truncate(self, step: int) -> None:
        """Drop the rows written after ``step`` by a run that died before its next save, and a
        line cut short by a kill."""
        if not self.path.is_file():
            return
        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [line for line in lines if _metric_step(line) <= step]
        if len(kept) < len(lines):
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(kept), encoding="utf-8")
            os.replace(tmp, self.path)


def _metric_step(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return math.inf


def read_metrics(path: str | Path) -> Rows:
    """The rows of a ``metrics.jsonl`` by kind, in step order; a step logged twice keeps its last
    row, and a line that is not JSON (cut short by a kill) is left out."""
    by_step: dict[str, dict[int, dict[str, Any]]] = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
            by_step.setdefault(row["kind"], {})[int(row["step"])] = row
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    return {kind: [rows[step] for step in sorted(rows)] for kind, rows in by_step.items()}
