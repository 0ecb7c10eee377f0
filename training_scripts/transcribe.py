#!/usr/bin/env python3
"""Transcribe audio with a konkanivani checkpoint (it carries its tokenizer and model shape).

    python training_scripts/transcribe.py checkpoints/run/best.pt clip.wav more_clips/ test.jsonl \
        --method joint --output transcripts.jsonl

Inputs are audio files (any sample rate and channel count soundfile reads), folders (searched
recursively) and JSONL manifests. Prints ``path<TAB>text`` per file, or writes JSONL rows
``{"audio_filepath", "text", "duration"}`` with ``--output``. A file that cannot be read is named
on stderr and the others are still transcribed; the exit status is then 1.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from konkanivani.checkpoint import CheckpointError  # noqa: E402
from konkanivani.data import ManifestError  # noqa: E402
from konkanivani.decode import DEFAULT_CTC_WEIGHT, METHODS  # noqa: E402
from konkanivani.inference import Recognizer, find_audio  # noqa: E402
from konkanivani.train import resolve_device  # noqa: E402


def add_decoding_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", choices=METHODS, default="joint",
                        help="greedy: best CTC path; beam: CTC prefix beam search; attention: attention beam search; "
                             "joint: attention beam search with CTC prefix scores; rescore: CTC n-best rescored "
                             "by the attention decoder (default: %(default)s)")
    parser.add_argument("--beam_size", type=int, default=10, help="default: %(default)s")
    parser.add_argument("--ctc_weight", type=float, default=DEFAULT_CTC_WEIGHT,
                        help="weight of the CTC score in joint decoding and rescoring (default: %(default)s)")
    parser.add_argument("--batch_size", type=int, default=8, help="utterances decoded together (default: %(default)s)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ... (default: %(default)s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("inputs", nargs="+", help="audio files, folders or JSONL manifests")
    parser.add_argument("--output", help="write JSONL here instead of printing")
    add_decoding_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stderr)
    try:
        recognizer = Recognizer.from_checkpoint(args.checkpoint, resolve_device(args.device))
        files = [path for path, _ in find_audio(args.inputs)]
    except (CheckpointError, ManifestError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not files:
        print("error: no audio files found in " + " ".join(args.inputs), file=sys.stderr)
        return 2

    failed, audio_s, start = [], 0.0, time.perf_counter()
    with open(args.output, "w", encoding="utf-8") if args.output else nullcontext() as out:
        for tr in recognizer.transcribe(files, args.method, args.beam_size, args.ctc_weight, args.batch_size):
            if tr.error is not None:
                failed.append(tr.error)
                continue
            audio_s += tr.duration
            if out is None:
                print(f"{tr.audio_filepath}\t{tr.text}", flush=True)
            else:
                row = {"audio_filepath": tr.audio_filepath, "text": tr.text, "duration": round(tr.duration, 3)}
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
    elapsed = time.perf_counter() - start
    rtf = elapsed / audio_s if audio_s else float("nan")
    print(f"{len(files) - len(failed)} files ({audio_s:.1f} s of audio) transcribed with {args.method} in "
          f"{elapsed:.1f} s: real-time factor {rtf:.3f}" + (f"; wrote {args.output}" if out else ""), file=sys.stderr)
    if failed:
        print(f"{len(failed)} files could not be read:", *failed, sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
