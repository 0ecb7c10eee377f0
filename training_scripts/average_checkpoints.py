#!/usr/bin/env python3
"""Average the weights of several checkpoints of one run into one checkpoint for decoding.

    python training_scripts/average_checkpoints.py checkpoints/run --last 5
    python training_scripts/average_checkpoints.py checkpoints/run --best 5 --output avg.pt
    python training_scripts/average_checkpoints.py --inputs a.pt b.pt --output avg.pt

``--last N`` takes the N newest step files; ``--best N`` the N with the lowest validation WER
among the end-of-epoch saves. Keep enough of them with ``--keep_checkpoints`` when training.
The result carries model, tokenizer and config (``transcribe.py`` and ``evaluate.py`` read it),
not the optimizer: it cannot be resumed.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from konkanivani.checkpoint import (CheckpointError, average_checkpoints, save_checkpoint,  # noqa: E402
                                    select_checkpoints)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", nargs="?", help="a training output directory")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--last", type=int, help="average the N newest step checkpoints")
    which.add_argument("--best", type=int, help="average the N with the lowest validation WER")
    which.add_argument("--inputs", nargs="+", help="average these checkpoint files")
    parser.add_argument("--output", help="default: DIRECTORY/average_last<N>.pt or average_best<N>.pt")
    args = parser.parse_args(argv)
    if args.inputs is None and args.directory is None:
        parser.error("give a training output directory with --last/--best, or files with --inputs")
    if (args.last or args.best or 1) < 1:
        parser.error("N must be at least 1")
    try:
        if args.inputs:
            paths = [Path(p) for p in args.inputs]
        else:
            paths = select_checkpoints(args.directory, last=args.last or 0, best=args.best or 0)
            wanted = args.last or args.best
            if len(paths) < wanted:
                print(f"warning: only {len(paths)} suitable checkpoints in {args.directory} (asked for {wanted})",
                      file=sys.stderr)
        output = Path(args.output) if args.output else (
            Path(args.directory) / f"average_{'last' if args.last else 'best'}{args.last or args.best}.pt")
        save_checkpoint(average_checkpoints(paths), output)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"averaged {len(paths)} checkpoints into {output}:", *paths, sep="\n  ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
