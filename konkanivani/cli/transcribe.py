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

import json
import sys
import time
from contextlib import nullcontext

from ..checkpoint import CheckpointError
from ..data.manifest import ManifestError
from ..decoding.recognizer import find_audio
from . import Parser, fail, refuse_writing_inputs, setup_logging, tool
from .decoding_flags import add_decoding_args, check_decoding_args, decoding_name, load_recognizer


@tool
def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    add_decoding_args(parser)
    parser.add_argument("inputs", nargs="+", help="audio files, folders or JSONL manifests")
    parser.add_argument("--output", help="write JSONL here instead of printing")
    args = parser.parse_args(argv)
    check_decoding_args(parser, args)
    refuse_writing_inputs(parser, "--output", args.output, [args.checkpoint, *args.inputs])
    setup_logging()
    try:
        recognizer = load_recognizer(args)
        files = [path for path, _ in find_audio(args.inputs)]
    except (CheckpointError, ManifestError, RuntimeError) as e:
        return fail(str(e))
    if not files:
        return fail("no audio files found in " + " ".join(args.inputs))

    failed, long_inputs, audio_s, start = [], 0, 0.0, time.perf_counter()
    with open(args.output, "w", encoding="utf-8") if args.output else nullcontext() as out:
        for tr in recognizer.transcribe(files, args.method, args.beam_size, args.decode_ctc_weight, args.batch_size,
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
