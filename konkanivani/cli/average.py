"""Average the weights of several checkpoints of one run into one checkpoint for decoding
(``konkanivani-average``).

    konkanivani-average checkpoints/run --last 5
    konkanivani-average checkpoints/run --best 5 --output avg.pt
    konkanivani-average --inputs a.pt b.pt --output avg.pt

``--last N`` takes the N newest step files; ``--best N`` the N with the lowest validation WER
among the end-of-epoch saves. Keep enough of them with ``--keep_checkpoints`` when training.
The result carries model, tokenizer and config (transcribe and evaluate read it), not the
optimizer: it cannot be resumed.
"""
from __future__ import annotations

import sys
from pathlib import Path

from ..checkpoint import (
    BEST_FILE,
    LATEST_FILE,
    STEP_FILES,
    CheckpointError,
    average_checkpoints,
    checkpoint_file_error,
    save_checkpoint,
    step_of,
)
from ..datatools.outputs import OutputError, check_outputs
from ..training.run_files import select_checkpoints
from . import Parser, fail, setup_logging, tool


def _refuse_overwriting_inputs(output: Path, inputs: list[Path]) -> None:
    """The average never replaces a checkpoint it reads (``check_outputs``), nor the latest.pt,
    best.pt or a step file of the run in its folder."""
    in_a_run = output.parent.is_dir() and (any(output.parent.glob(STEP_FILES)) or
                                           (output.parent / LATEST_FILE).exists())
    if in_a_run and (output.name in (LATEST_FILE, BEST_FILE) or step_of(output.name) is not None):
        raise CheckpointError(
            f"--output {output}: that name belongs to a training run's own checkpoints; "
            "choose another (average_*.pt)"
        )
    try:
        check_outputs({"--output": output}, inputs)
    except OutputError as e:
        raise CheckpointError(str(e)) from None


@tool
def main(argv: list[str] | None = None) -> int:
    setup_logging()
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", nargs="?", type=Path, help="a training output directory")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--last", type=int, help="average the N newest step checkpoints")
    which.add_argument("--best", type=int, help="average the N with the lowest validation WER")
    which.add_argument("--inputs", nargs="+", type=Path, help="average these checkpoint files")
    parser.add_argument(
        "--output", help="default: DIRECTORY/average_last<N>.pt or average_best<N>.pt"
    )
    args = parser.parse_args(argv)
    if args.inputs is None and args.directory is None:
        parser.error("give a training output directory with --last/--best, or files with --inputs")
    if args.inputs is None and not args.directory.is_dir():
        parser.error(f"{args.directory}: no such directory")
    for name in ("last", "best"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if why := next(filter(None, (checkpoint_file_error(p, "--inputs") for p in args.inputs or [])),
                   None):
        parser.error(why)
    try:
        if args.inputs:
            paths = args.inputs
        else:
            paths = select_checkpoints(args.directory, last=args.last or 0, best=args.best or 0)
            wanted = args.last or args.best
            if len(paths) < wanted:
                print(
                    f"warning: only {len(paths)} suitable checkpoints in {args.directory} (asked"
                    f" for {wanted})",
                    file=sys.stderr,
                )
        output = (
            Path(args.output)
            if args.output
            else (
                args.directory
                / f"average_{'last' if args.last else 'best'}{args.last or args.best}.pt"
            )
        )
        _refuse_overwriting_inputs(output, paths)
        save_checkpoint(average_checkpoints(paths), output)
    except CheckpointError as e:
        return fail(str(e))
    print(f"averaged {len(paths)} checkpoints into {output}:", *paths, sep="\n  ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
