"""Learning curves drawn from ``metrics.jsonl``: the loss (training and validation), CER and WER,
and the learning rate, against the optimizer step.

Training redraws ``RUN_DIR/curves.png`` after each validation (``write_curves``);
``konkanivani-plot`` draws one run or several in one figure, one line per run (``plot_runs``).
matplotlib is optional (``pip install "konkanivani[plot]"``). Examples::

    write_curves(Path("checkpoints/run"))  # checkpoints/run/curves.png
    plot_runs([Path("runs/a"), Path("runs/b")], Path("a_vs_b.png"))
"""
from __future__ import annotations

import csv
import importlib.util
import io
import math
from pathlib import Path
from typing import Any, Optional, Sequence

from ..checkpoint import METRICS_FILE, atomic_file
from .metrics_log import Rows, read_metrics

__all__ = ["CURVES", "have_matplotlib", "run_labels", "write_curves", "plot_runs", "write_csv"]

CURVES = "curves.png"

def have_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def run_labels(run_dirs: Sequence[Path]) -> list[str]:
    """Each run's directory name; the paths as given where two names are the same."""
    names = [Path(d).resolve().name for d in run_dirs]
    return names if len(set(names)) == len(names) else [str(d) for d in run_dirs]


def write_csv(
    path: str | Path, rows: Sequence[dict[str, Any]], columns: Optional[Sequence[str]] = None
) -> None:
    """``rows`` as a CSV table with a header, as the benchmarks keep their results beside their
    plots and a sweep its table: the ``columns`` given (a row's other keys left out, a missing one
    empty),
    else the first row's keys. Written atomically: a reader sees the old table or the new one."""
    with atomic_file(path) as raw:
        text = io.TextIOWrapper(raw, encoding="utf-8", newline="")
        writer = csv.DictWriter(text, fieldnames=list(columns or rows[0]), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
        text.flush()
        text.detach()  # atomic_file syncs, closes and renames the file itself


def text_table(rows: Sequence[dict[str, Any]], keys: Sequence[str], titles: Sequence[str]) -> str:
    """``rows`` as a markdown table with columns padded to their widths, as the benchmarks print
    them: the values of ``keys``, under ``titles``.

    >>> print(text_table([{"chunk": 16, "cer": 5.2}], ["chunk", "cer"], ["chunk", "CER %"]))
    | chunk | CER % |
    |-------|-------|
    | 16    | 5.2   |
    """
    cells = [[str(r[k]) for k in keys] for r in rows]
    widths = [max(len(t), *(len(c[i]) for c in cells)) for i, t in enumerate(titles)]
    lines = ["| " + " | ".join(t.ljust(w) for t, w in zip(titles, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    return "\n".join(
        lines + ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    )


def write_curves(run_dir: str | Path) -> Path:
    """Redraw ``RUN_DIR/curves.png`` from ``RUN_DIR/metrics.jsonl``; returns its path."""
    run_dir = Path(run_dir)
    return plot_runs([run_dir], run_dir / CURVES)


def plot_runs(run_dirs: Sequence[Path], output: str | Path) -> Path:
    """One figure of the runs' curves, each run in a colour of its own, labelled by directory name
    when there are several. The PNG is written to a temporary file and renamed into place, so a
    reader (an image viewer that reloads it) never sees half of it."""
    labels = run_labels(run_dirs)
    runs = {label: read_metrics(Path(d) / METRICS_FILE) for label, d in zip(labels, run_dirs)}
    figure = _draw(runs, title=labels[0] if len(labels) == 1 else None)
    output = Path(output)
    with atomic_file(output) as f:
        figure.savefig(f, format="png", dpi=100)
    return output


def _draw(runs: dict[str, Rows], title: Optional[str]) -> Any:
    # A Figure of its own, not pyplot: no global figure list, no GUI backend, safe off the main
    # thread.
    from matplotlib.figure import Figure

    figure = Figure(figsize=(15, 4.2), layout="constrained")
    loss_ax, error_ax, lr_ax = figure.subplots(1, 3)
    several = len(runs) > 1
    for i, (label, rows) in enumerate(runs.items()):
        train, valid = rows.get("train", []), rows.get("valid", [])
        name = f"{label} " if several else ""
        colour = f"C{i}" if several else None
        loss_ax.plot(*_series(train, "loss"), color=colour or "C0", lw=1, label=f"{name}train")
        loss_ax.plot(
            *_series(valid, "loss"), "o--", color=colour or "C1", ms=4, label=f"{name}valid"
        )
        error_ax.plot(
            *_series(valid, "cer", scale=100), "o-", color=colour or "C0", ms=4, label=f"{name}CER"
        )
        error_ax.plot(
            *_series(valid, "wer", scale=100), "s--", color=colour or "C1", ms=4, label=f"{name}WER"
        )
        lr_ax.plot(*_series(train, "lr"), color=colour or "C0", lw=1, label=label)
    if any(v > 0 for line in loss_ax.get_lines() for v in line.get_ydata() if math.isfinite(v)):
        loss_ax.set_yscale("log")  # losses fall by two orders of magnitude in the first epochs
    for ax, what in ((loss_ax, "loss per utterance"), (error_ax, "validation error rate (%)"),
                     (lr_ax, "learning rate")):
        ax.set_xlabel("optimizer step")
        ax.set_title(what)
        ax.grid(alpha=0.3)
    loss_ax.legend(fontsize="small")
    error_ax.legend(fontsize="small")
    if several:
        lr_ax.legend(fontsize="small")
    error_ax.set_ylim(bottom=0)
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    if title:
        figure.suptitle(title)
    return figure


def _series(
    rows: list[dict[str, Any]], name: str, scale: float = 1.0
) -> tuple[list[int], list[float]]:
    """Steps and values of one figure; a missing or non-finite one (null in the file) is NaN, a gap
    in the line."""
    steps = [row["step"] for row in rows]
    values = [
        row[name] * scale if isinstance(row.get(name), (int, float)) else math.nan for row in rows
    ]
    return steps, values
