"""Transcribe audio with a konkanivani checkpoint (``konkanivani-transcribe``); the checkpoint carries
its tokenizer and model shape.

    konkanivani-transcribe checkpoints/run/best.pt clip.wav more_clips/ test.jsonl \\
        --method joint --output transcripts.jsonl

Inputs are audio files (any sample rate and channel count soundfile reads), folders (searched
recursively) and JSONL manifests. Prints ``path<TAB>text`` per file, or writes JSONL rows
``{"audio_filepath", "text", "duration"}`` with ``--output``. A file that cannot be read, is too
short for the model (under 0.06 s) or fails to decode is named once on stderr and the others are
still transcribed; the exit status is then 1. Files longer than 30 s asked of an attention-based
method (joint, attention, rescore) are decoded with CTC prefix beam search, said once on stderr.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from contextlib import nullcontext
from pathlib import Path

from . import Parser, fail, refuse_writing_inputs, tool
from ..checkpoint import CheckpointError
from ..data.manifest import ManifestError
from ..decoding.search import DEFAULT_CTC_WEIGHT, FUSED_METHODS, LONG_INPUT_METHOD, LONG_INPUT_SECONDS, METHODS
from ..decoding.recognizer import Recognizer, find_audio
from ..training.precision import resolve_device


DEFAULT_LM_WEIGHT = 0.3


def add_decoding_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", type=Path, help="a step checkpoint, latest.pt, best.pt or an average")
    parser.add_argument("--method", choices=METHODS, default="joint",
                        help="greedy: best CTC path; beam: CTC prefix beam search; attention: attention beam search; "
                             "joint: attention beam search with CTC prefix scores; rescore: CTC n-best rescored "
                             "by the attention decoder (default: %(default)s)")
    parser.add_argument("--beam_size", type=int, default=10, help="default: %(default)s")
    parser.add_argument("--ctc_weight", type=float, default=DEFAULT_CTC_WEIGHT,
                        help="weight of the CTC score in joint decoding and rescoring (default: %(default)s)")
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
    if not 0.0 <= args.ctc_weight <= 1.0:
        parser.error(f"--ctc_weight must be in [0, 1], got {args.ctc_weight}")
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


@tool
def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    add_decoding_args(parser)
    parser.add_argument("inputs", nargs="+", help="audio files, folders or JSONL manifests")
    parser.add_argument("--output", help="write JSONL here instead of printing")
    args = parser.parse_args(argv)
    check_decoding_args(parser, args)
    refuse_writing_inputs(parser, "--output", args.output, [args.checkpoint, *args.inputs])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stderr)
    try:
        recognizer = load_recognizer(args)
        files = [path for path, _ in find_audio(args.inputs)]
    except (CheckpointError, ManifestError, RuntimeError) as e:
        return fail(str(e))
    if not files:
        return fail("no audio files found in " + " ".join(args.inputs))

    failed, long_inputs, audio_s, start = [], 0, 0.0, time.perf_counter()
    with open(args.output, "w", encoding="utf-8") if args.output else nullcontext() as out:
        for tr in recognizer.transcribe(files, args.method, args.beam_size, args.ctc_weight, args.batch_size,
                                        args.lm_weight, args.length_bonus):
            if tr.error is not None:
                failed.append(tr.error)
                continue
            audio_s += tr.duration
            long_inputs += tr.method != args.method
            if out is None:
                print(f"{tr.audio_filepath}\t{tr.text}", flush=True)
            else:
                row = {"audio_filepath": tr.audio_filepath, "text": tr.text, "duration": round(tr.duration, 3)}
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
    elapsed = time.perf_counter() - start
    done = len(files) - len(failed)
    speed = f" in {elapsed:.1f} s: real-time factor {elapsed / audio_s:.3f}" if audio_s else ""
    print(f"{done} of {len(files)} files ({audio_s:.1f} s of audio) transcribed with "
          f"{decoding_name(args, long_inputs)}{speed}" + (f"; wrote {args.output}" if args.output else ""),
          file=sys.stderr)
    if failed:
        print(f"{len(failed)} files could not be transcribed:", *failed, sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
