"""Draw the learning curves of one training run, or compare several (``konkanivani-plot``).

    konkanivani-plot checkpoints/run                       # redraws checkpoints/run/curves.png
    konkanivani-plot runs/small runs/medium -o compare.png # one line per run, named by its
    directory

Loss (training and validation), CER and WER, and the learning rate against the optimizer step,
from each directory's metrics.jsonl. Needs matplotlib (``pip install "konkanivani[plot]"``).
"""
from __future__ import annotations

import sys
from pathlib import Path

from ..checkpoint import METRICS_FILE
from ..experiments.trials import SWEEP_FILE, TRIAL_FILE, plot_sweep
from ..training.curves import CURVES, have_matplotlib, plot_runs
from ..training.metrics_log import read_metrics
from . import Parser, fail, refuse_unsafe_outputs, setup_logging, tool


@tool
def main(argv: list[str] | None = None) -> int:
    setup_logging()
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "run_dirs",
        nargs="+",
        type=Path,
        metavar="RUN_DIR",
        help="training output directories, or one konkanivani-sweep folder",
    )
    parser.add_argument(
        "-o",
        "--output",
        type=Path,
        help=(
            f"the PNG to write (default with one RUN_DIR: RUN_DIR/{CURVES}; required with several)"
        ),
    )
    args = parser.parse_args(argv)
    if args.output is None and len(args.run_dirs) > 1:
        parser.error("give -o PNG to compare several runs")
    # a konkanivani-sweep folder
    if len(args.run_dirs) == 1 and (args.run_dirs[0] / SWEEP_FILE).is_file():
        folder = args.run_dirs[0]
        reads = [folder / SWEEP_FILE, *folder.glob(f"*/{TRIAL_FILE}"),
                 *folder.glob("*/metrics.jsonl")]
        refuse_unsafe_outputs(parser, {"-o": args.output}, reads)
        return _plot_sweep(folder, args.output)
    for run_dir in args.run_dirs:
        metrics = run_dir / METRICS_FILE
        if not metrics.is_file():
            return fail(
                f"{run_dir}: no metrics.jsonl (not a training output directory, or no step logged"
                " yet)"
            )
        if not read_metrics(metrics):
            return fail(f"{metrics}: no rows yet")
    if not have_matplotlib():
        return fail('drawing needs matplotlib: pip install "konkanivani[plot]"')
    output = args.output or args.run_dirs[0] / CURVES
    refuse_unsafe_outputs(parser, {"-o": output}, [d / METRICS_FILE for d in args.run_dirs])
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        plot_runs(args.run_dirs, output)
    except OSError as e:
        return fail(f"could not write {output}: {e}")
    print(f"wrote {output}")
    return 0


def _plot_sweep(folder: Path, output: Path | None) -> int:
    """A sweep's folder: the same sweep.png as the sweep draws (CER against time, best CER against
    size)."""
    if not have_matplotlib():
        return fail('drawing needs matplotlib: pip install "konkanivani[plot]"')
    try:
        written = plot_sweep(folder, output)
    except OSError as e:
        return fail(f"could not write {output or folder / 'sweep.png'}: {e}")
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
