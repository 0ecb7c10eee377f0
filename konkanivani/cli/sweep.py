"""Sweep trainer flags over a grid (``konkanivani-sweep``; the code is
konkanivani/experiments/trials.py).

    konkanivani-sweep --output_dir checkpoints/sizes --grid preset=small,medium,large --grid
        lr=1e-3,2e-3 \\ --config configs/t4.yaml --max_steps 2000 --gpu_gb 15 --target_cer 10

Every flag that is not the sweep's own goes to every trial, as ``konkanivani-train`` reads it; a
``sweep:`` section in the ``--config`` recipe may hold the grid (``grid: {lr: [1e-3, 2e-3]}``) and
the options below. Each trial is a run directory ``OUTPUT_DIR/<its settings>``, so resuming, curves,
TensorBoard, evaluate and export work on it as on any run. Run the same command again to continue a
sweep that stopped; ``OUTPUT_DIR/sweep.md`` and ``sweep.csv`` tabulate the trials.

``--search optuna --trials N`` samples the trials from the recipe's ``sweep: search:`` space instead
(konkanivani/experiments/optuna_search.py): pruned by validation CER, the study in
``OUTPUT_DIR/study.db`` (or ``--storage URL``, shared by several machines), resumed by the same
command.

Exit status: 0 when every trial ended (finished or skipped as too large), 1 when one failed, 2 for
a bad flag or grid, 130 / 143 when SIGINT / SIGTERM stopped the sweep after saving its trial.
"""
from __future__ import annotations

import argparse
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

from ..checkpoint import CheckpointError
from ..config import (
    ConfigError,
    TrainConfig,
    check_config,
    dataclass_from_args,
    model_config_from_preset,
)
from ..config_file import load_sweep_section
from ..data.manifest import ManifestError
from ..experiments.optuna_search import parse_space, run_search
from ..experiments.trials import SweepError, check_sweep_folder, grid_trials, parse_grid, run_sweep
from . import Parser, fail, setup_logging, tool
from . import train as train_cli


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The sweep's own flags, and the rest: the flags every trial's trainer gets."""
    p = _parser()
    args, rest = p.parse_known_args(argv)
    config = _config_path(rest)
    section = load_sweep_section(config) if config else {}
    args.grid = [
        f"{k}={','.join(map(str, v))}" for k, v in section.get("grid", {}).items()
    ] + args.grid
    args.space = section.get("search")
    if args.search and args.grid:
        p.error(
            "--search samples the recipe's sweep: search: space; give no --grid (nor sweep: grid:)"
            " with it"
        )
    if args.search and not args.space:
        p.error(
            "--search optuna needs a sweep: search: section in the --config recipe (see"
            " docs/training.md)"
        )
    if args.trials < 1:
        p.error(f"--trials must be a positive integer, got {args.trials}")
    args.gpu_gb = section.get("gpu_gb", 0.0) if args.gpu_gb is None else args.gpu_gb
    args.target_cer = section.get("target_cer") if args.target_cer is None else args.target_cer
    if args.target_cer is not None and not 0 < args.target_cer <= 100:
        p.error(f"--target_cer must be in (0, 100] (a CER in percent), got {args.target_cer:g}")
    args.target_cer = args.target_cer or 0.0  # 0: no target
    if args.gpu_gb < 0:
        p.error(f"--gpu_gb must be positive, got {args.gpu_gb:g}")
    for flag in ("--output_dir", "--resume", "--overwrite"):
        if any(a == flag or a.startswith(flag + "=") for a in rest):
            p.error(f"{flag} is the sweep's to set for each trial")
    return args, rest


def _parser() -> Parser:
    """The sweep's own flags; the rest go to the trainer."""
    p = Parser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Any konkanivani-train flag (see konkanivani-train --help) goes to every trial.",
    )
    p.add_argument(
        "--output_dir",
        type=Path,
        required=True,
        help="the sweep's folder; one run directory per trial",
    )
    p.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="FLAG=V1,V2",
        help="a trainer flag and its values; repeat for more flags (every combination is a trial)",
    )
    p.add_argument(
        "--gpu_gb",
        type=float,
        default=None,
        help=(
            "skip a trial the memory planner says cannot fit this many GiB (default: the recipe's "
            "sweep: gpu_gb, else no check)"
        ),
    )
    p.add_argument(
        "--target_cer",
        type=float,
        default=None,
        help="report when each trial reached this validation CER, in percent (default: none)",
    )
    p.add_argument(
        "--search",
        choices=("optuna",),
        default=None,
        help=(
            "sample --trials trials from the recipe's sweep: search: space with Optuna (TPE, median"
            " pruning at --validate_every_steps) instead of a grid"
        ),
    )
    p.add_argument(
        "--trials",
        type=int,
        default=10,
        help="with --search: trials to complete (default: %(default)s)",
    )
    p.add_argument(
        "--storage",
        default="",
        help=(
            "with --search: an Optuna storage URL shared by several machines (default:"
            " OUTPUT_DIR/study.db)"
        ),
    )
    p.add_argument(
        "--study_name", default="konkanivani-sweep", help="with --search: the study in --storage"
    )
    return p


def _config_path(rest: list[str]) -> str | None:
    for i, arg in enumerate(rest):
        if arg == "--config" and i + 1 < len(rest):
            return rest[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def _flag(name: str, value: Any) -> list[str]:
    if isinstance(value, bool):
        return [f"--{name}" if value else f"--no_{name}"]
    return [f"--{name}", str(value)]


def trial_maker(shared: list[str]):
    """``make_trial(settings, output_dir, resume)``: the trainer's config for one trial, read by the
    trainer's own parser from the shared flags, the trial's settings and its folder."""
    def make_trial(
        settings: dict[str, Any], output_dir: Path, resume: str
    ) -> tuple[TrainConfig, dict[str, Any]]:
        argv = [
            *shared,
            *(a for k, v in settings.items() for a in _flag(k, v)),
            "--output_dir",
            str(output_dir),
        ]
        args = train_cli.parse_args([*argv, *(["--resume", resume] if resume else [])])
        return dataclass_from_args(TrainConfig, args), train_cli.model_flags(args)

    return make_trial


def check_trial(cfg: TrainConfig, flags: dict[str, Any]) -> None:
    """A trial's flags, checked before any trial runs: its config, and its model flags over the
    preset (``ConfigError`` naming the first bad one)."""
    check_config(cfg)
    model_config_from_preset(cfg.preset, **flags)


@tool
def main(argv: list[str] | None = None) -> int:
    setup_logging()
    argv = sys.argv[1:] if argv is None else argv
    try:
        args, shared = parse_args(argv)
        # Before any trial: the sweep's tables would replace another's files.
        check_sweep_folder(args.output_dir)
        make_trial = trial_maker(shared)
        if args.search:
            space = parse_space(args.space, _config_path(shared))
            # the shared flags, checked at once
            cfg, flags = make_trial({}, args.output_dir / "trial-0000", "")
            check_trial(cfg, flags)
            trials, stopped = run_search(
                args.output_dir,
                space,
                make_trial,
                args.trials,
                args.storage,
                args.study_name,
                args.target_cer,
                shared,
            )
        else:
            grid = parse_grid(args.grid)
            # every trial's flags, checked before the first one runs
            for trial in grid_trials(grid):
                cfg, flags = make_trial(trial.settings, args.output_dir / trial.name, "")
                check_trial(cfg, flags)
            trials, stopped = run_sweep(
                args.output_dir, grid, make_trial, args.gpu_gb, args.target_cer, shared
            )
    except (SweepError, ConfigError, CheckpointError, ManifestError) as e:
        return fail(str(e))
    counts = {
        s: sum(t.status == s for t in trials)
        for s in ("done", "pruned", "skipped", "failed", "stopped")
    }
    print(f"{len(trials)} trials: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
          + f"; table in {args.output_dir / 'sweep.md'}")
    if stopped is not None:
        print(f"stopped by {stopped}; continue with:\n  {shlex.join(['konkanivani-sweep', *argv])}")
        return 128 + signal.Signals[stopped]
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
