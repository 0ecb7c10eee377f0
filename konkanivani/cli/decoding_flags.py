"""The decoding flags that konkanivani-transcribe and konkanivani-evaluate share, and their checks.

The CTC weight of decoding is ``--decode_ctc_weight`` (0.7 by default: joint decoding and
rescoring lean on CTC) in every tool, apart from training's ``--ctc_weight``, the weight of the
CTC loss (0.3); ``--ctc_weight`` stays here as an old spelling that says so once.

konkanivani-transcribe also takes the flags of streaming (``add_decoding_args(parser, streaming=True)``):
``--chunk_size`` and those that go with it; its ``--method`` is then ``rescore`` unless given.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ..config import Renamed
from ..decoding.recognizer import Recognizer
from ..decoding.search import DEFAULT_CTC_WEIGHT, FUSED_METHODS, LONG_INPUT_METHOD, LONG_INPUT_SECONDS, METHODS
from ..decoding.streaming import DEFAULT_ENDPOINT_MS, MAX_SEGMENT_SECONDS, STREAM_METHODS, WINDOW_SECONDS
from ..training.precision import resolve_device
from . import Parser

__all__ = ["DEFAULT_LM_WEIGHT", "add_decoding_args", "check_decoding_args", "check_streaming_args",
           "decoding_inputs", "decoding_name", "load_recognizer"]


DEFAULT_LM_WEIGHT = 0.3
DEFAULT_METHOD = "joint"
STREAMING_DEFAULT_METHOD = "rescore"


def add_decoding_args(parser: argparse.ArgumentParser, streaming: bool = False) -> None:
    """The decoding flags; with ``streaming`` also those of streaming (``check_streaming_args``)."""
    parser.add_argument("checkpoint", type=Path, help="a step checkpoint, latest.pt, best.pt or an average")
    default = f"{DEFAULT_METHOD}; with --chunk_size {STREAMING_DEFAULT_METHOD}" if streaming else "%(default)s"
    parser.add_argument("--method", choices=METHODS, default=None if streaming else DEFAULT_METHOD,
                        help="greedy: best CTC path; beam: CTC prefix beam search; attention: attention beam search; "
                             "joint: attention beam search with CTC prefix scores; rescore: CTC n-best rescored "
                             f"by the attention decoder (default: {default})")
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
    if streaming:
        _add_streaming_args(parser)


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


def _add_streaming_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chunk_size", type=int, default=0,
                        help="decode as a stream, in chunks of this many encoder frames (40 ms each), with a model "
                             "trained with --causal_conv (and --dynamic_chunk); each segment printed with its times. "
                             f"0: each file whole, a file over {LONG_INPUT_SECONDS:g} s in windows of at most "
                             f"{WINDOW_SECONDS:g} s (default: %(default)s)")
    parser.add_argument("--left_chunks", type=int, default=-1,
                        help="with --chunk_size: how many chunks back each chunk sees (-1: all of its segment; "
                             "default: %(default)s)")
    parser.add_argument("--stream", action="store_true",
                        help="with --chunk_size: print partial results on stderr as they change")
    parser.add_argument("--endpoint_ms", type=int, default=None,
                        help=f"with --chunk_size: end a segment after this many ms in which CTC's likeliest output "
                             f"is blank, after speech (default: {DEFAULT_ENDPOINT_MS}; 0: segments end only at "
                             f"{MAX_SEGMENT_SECONDS:g} s)")


def check_streaming_args(parser: Parser, args: argparse.Namespace) -> None:
    """The streaming flags' values, and ``--method``'s default (before ``check_decoding_args``)."""
    if args.chunk_size < 0:
        parser.error(f"--chunk_size must be 0 (whole files) or a positive number of encoder frames, got "
                     f"{args.chunk_size}")
    if not args.chunk_size:
        given = [flag for flag, value in (("--left_chunks", args.left_chunks != -1), ("--stream", args.stream),
                                          ("--endpoint_ms", args.endpoint_ms is not None)) if value]
        if given:
            parser.error(f"{given[0]} needs --chunk_size N (streaming)")
        args.method = args.method or DEFAULT_METHOD
        return
    if args.left_chunks < -1:
        parser.error(f"--left_chunks must be -1 (all) or >= 0, got {args.left_chunks}")
    if args.endpoint_ms is not None and args.endpoint_ms < 0:
        parser.error(f"--endpoint_ms must be >= 0 (0: no endpointing), got {args.endpoint_ms}")
    args.endpoint_ms = DEFAULT_ENDPOINT_MS if args.endpoint_ms is None else args.endpoint_ms
    args.method = args.method or STREAMING_DEFAULT_METHOD
    if args.method not in STREAM_METHODS:
        parser.error(f"--method {args.method} cannot stream; with --chunk_size choose from {', '.join(STREAM_METHODS)}")


def decoding_inputs(args: argparse.Namespace) -> list[Path]:
    """The files the decoding flags name, which every decoding run reads: the checkpoint, the LM."""
    return [args.checkpoint, *([args.lm] if args.lm is not None else [])]


def load_recognizer(args: argparse.Namespace) -> Recognizer:
    return Recognizer.from_checkpoint(args.checkpoint, resolve_device(args.device), lm=args.lm)


def decoding_name(args: argparse.Namespace, long_inputs: int = 0) -> str:
    """The method and its fusion settings, for the summary line, and how many of the inputs were
    too long for it (decoded with ``LONG_INPUT_METHOD``)."""
    fusion = f" + LM {args.lm} at {args.lm_weight:g}" if args.lm is not None else ""
    name = args.method + fusion + (f", length bonus {args.length_bonus:g}" if args.length_bonus else "")
    return name + (f" ({long_inputs} over {LONG_INPUT_SECONDS:g} s with {LONG_INPUT_METHOD})" if long_inputs else "")
