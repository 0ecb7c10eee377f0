"""The decoding flags that konkanivani-transcribe and konkanivani-evaluate share, and their checks.

The CTC weight of decoding is ``--decode_ctc_weight`` (0.7 by default: joint decoding and
rescoring lean on CTC) in every tool, apart from training's ``--ctc_weight``, the weight of the
CTC loss (0.3); ``--ctc_weight`` stays here as an old spelling that says so once.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ..config import Renamed
from ..decoding.recognizer import Recognizer
from ..decoding.search import DEFAULT_CTC_WEIGHT, FUSED_METHODS, LONG_INPUT_METHOD, LONG_INPUT_SECONDS, METHODS
from ..training.precision import resolve_device
from . import Parser

__all__ = ["DEFAULT_LM_WEIGHT", "add_decoding_args", "check_decoding_args", "decoding_name", "load_recognizer"]


DEFAULT_LM_WEIGHT = 0.3


def add_decoding_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", type=Path, help="a step checkpoint, latest.pt, best.pt or an average")
    parser.add_argument("--method", choices=METHODS, default="joint",
                        help="greedy: best CTC path; beam: CTC prefix beam search; attention: attention beam search; "
                             "joint: attention beam search with CTC prefix scores; rescore: CTC n-best rescored "
                             "by the attention decoder (default: %(default)s)")
    parser.add_argument("--beam_size", type=int, default=10, help="default: %(default)s")
    parser.add_argument("--decode_ctc_weight", type=float, default=DEFAULT_CTC_WEIGHT,
                        help="weight of the CTC score in joint decoding and rescoring (default: %(default)s; "
                             "training's --ctc_weight is the loss's)")
    parser.add_argument("--ctc_weight", dest="decode_ctc_weight", type=float, action=Renamed,
                        new="--decode_ctc_weight", help=argparse.SUPPRESS)
    parser.add_argument("--lm", type=Path, metavar="CHECKPOINT",
                        help="a konkanivani-train-lm checkpoint of the same tokenizer, for shallow fusion "
                             f"({', '.join(FUSED_METHODS)})")
    parser.add_argument("--lm_weight", type=float, default=None,
                        help=f"weight W of the LM's log-probabilities (default with --lm: {DEFAULT_LM_WEIGHT}, a common "
                             "starting point; choose it on a validation set with benchmarks/lm_fusion.py)")
    parser.add_argument("--length_bonus", type=float, default=0.0,
                        help="score B added per emitted token, against the LM's preference for short outputs "
                             "(default: %(default)s)")
    parser.add_argument("--batch_size", type=int, default=8, help="utterances decoded together (default: %(default)s)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ... (default: %(default)s)")


def check_decoding_args(parser: Parser, args: argparse.Namespace) -> None:
    """The decoding flags' values, before the model is loaded (one line, exit 2)."""
    if not args.checkpoint.is_file():
        parser.error(f"checkpoint {args.checkpoint}: file not found")
    if args.beam_size < 1 or args.batch_size < 1:
        parser.error(f"--{'beam_size' if args.beam_size < 1 else 'batch_size'} must be a positive integer")
    if not 0.0 <= args.decode_ctc_weight <= 1.0:
        parser.error(f"--decode_ctc_weight must be in [0, 1], got {args.decode_ctc_weight}")
    if args.lm is None and args.lm_weight is not None:
        parser.error("--lm_weight needs --lm CHECKPOINT")
    if args.lm is not None and not args.lm.is_file():
        parser.error(f"--lm {args.lm}: file not found")
    args.lm_weight = (DEFAULT_LM_WEIGHT if args.lm is not None else 0.0) if args.lm_weight is None else args.lm_weight
    if args.lm_weight < 0:
        parser.error(f"--lm_weight must be >= 0, got {args.lm_weight}")
    if (args.lm is not None or args.length_bonus) and args.method not in FUSED_METHODS:
        parser.error(f"--method {args.method} takes no --lm or --length_bonus; choose from {', '.join(FUSED_METHODS)}")


def load_recognizer(args: argparse.Namespace) -> Recognizer:
    return Recognizer.from_checkpoint(args.checkpoint, resolve_device(args.device), lm=args.lm)


def decoding_name(args: argparse.Namespace, long_inputs: int = 0) -> str:
    """The method and its fusion settings, for the summary line, and how many of the inputs were
    too long for it (decoded with ``LONG_INPUT_METHOD``)."""
    fusion = f" + LM {args.lm} at {args.lm_weight:g}" if args.lm is not None else ""
    name = args.method + fusion + (f", length bonus {args.length_bonus:g}" if args.length_bonus else "")
    return name + (f" ({long_inputs} over {LONG_INPUT_SECONDS:g} s with {LONG_INPUT_METHOD})" if long_inputs else "")
