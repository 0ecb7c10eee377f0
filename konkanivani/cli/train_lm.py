"""Train a language model on text alone for shallow fusion (``konkanivani-train-lm``; the code is
konkanivani/training/lm_training.py, on the ASR trainer's machinery).

    konkanivani-train-lm corpus.txt more.txt --tokenizer checkpoints/run/best.pt \\
        --output_dir checkpoints/lm --valid_text valid.txt --max_steps 20000

One sentence a line, normalized as transcripts are (``normalize_text``) and tokenized with the
ASR checkpoint's own tokenizer (or a ``.model`` file), which the LM checkpoint then carries:
decoding refuses an LM whose pieces differ from the recognizer's. Blank lines are skipped and
counted. Without ``--valid_text`` a small held-out fraction of the text measures validation
perplexity. Checkpoints are written atomically to ``OUTPUT_DIR`` (``step_*.pt``, ``latest.pt``,
``best.pt`` by validation perplexity, ``metrics.jsonl``); ``--resume latest`` goes on exactly where
a run stopped (``--max_time``, Ctrl-C, a kill), giving the losses an unbroken run gives.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..checkpoint import CheckpointError
from ..config import ConfigError, add_dataclass_args, dataclass_from_args
from ..model.lm import LMConfig
from ..training.lm_training import LMTrainConfig, TextError, train_lm
from . import Parser, fail, setup_logging, tool


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags: every field of ``LMTrainConfig`` (the text files positional) and of
    ``LMConfig``."""
    p = Parser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("text", nargs="+", type=Path, help="text files, one sentence a line")
    add_dataclass_args(p.add_argument_group("training"), LMTrainConfig, skip=("text",))
    add_dataclass_args(p.add_argument_group("model"), LMConfig)
    return p.parse_args(argv)


def configs(args: argparse.Namespace) -> tuple[LMTrainConfig, LMConfig]:
    """The run's and the model's configs from the flags."""
    return (dataclass_from_args(LMTrainConfig, args, text=[str(t) for t in args.text]),
            dataclass_from_args(LMConfig, args))


@tool
def main(argv: list[str] | None = None) -> int:
    setup_logging()
    args = parse_args(argv)
    try:
        summary = train_lm(*configs(args))
    except (ConfigError, TextError, CheckpointError, RuntimeError) as e:
        return fail(str(e))
    stop = summary["stop"]
    print(
        f"step {summary['step']}: validation perplexity {summary['valid_ppl']:.2f} (best"
        f" {summary['best_ppl']:.2f}); checkpoints in {args.output_dir}"
        + (f"; stopped by {stop.reason}, continue with --resume latest" if stop.early else "")
    )
    return stop.exit_code


if __name__ == "__main__":
    sys.exit(main())
