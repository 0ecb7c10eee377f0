"""Score a konkanivani checkpoint on a manifest (``konkanivani-evaluate``): WER and CER with
substitutions, deletions and insertions, the worst utterances, per-utterance JSONL and a markdown
report.

    konkanivani-evaluate checkpoints/run/best.pt data/demo/test.jsonl \\ --method joint --output
        results.jsonl --report report.md konkanivani-evaluate checkpoints/streaming/best.pt
        data/demo/test.jsonl --method rescore --chunk_size 16

``--output`` and ``--report`` may be neither the same file nor one the run reads (the checkpoint,
the manifest, an audio file it lists): refused before anything is decoded. Both are written when
scoring ends, each through a temporary file renamed into place.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..checkpoint import CheckpointError
from ..data.manifest import ManifestError, manifest_audio, refuse_pseudo_labels
from ..datatools.outputs import OutputError, write_output
from ..decoding.evaluation import evaluate_manifest, markdown_report
from . import Parser, fail, refuse_unsafe_outputs, setup_logging, tool
from .decoding_flags import (
    add_decoding_args,
    checked_decoding,
    decoding_inputs,
    decoding_name,
    load_recognizer,
)

# The DecodingConfig fields konkanivani-evaluate takes as flags (docs/generate_flags.py reads them):
# its --chunk_size encodes each utterance under a stream's chunk mask, batched.
DECODING_FIELDS = ("method", "beam_size", "ctc_weight", "lm", "lm_weight", "length_bonus",
                   "batch_size", "chunk_size", "left_chunks", "device", "hotwords", "hotword_boost")


@tool
def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    add_decoding_args(parser, DECODING_FIELDS)
    parser.add_argument("manifest", type=Path)
    parser.add_argument("--output", help="per-utterance results as JSONL")
    parser.add_argument("--report", help="write a markdown report here")
    parser.add_argument(
        "--worst", type=int, default=10, help="how many of the worst utterances to list"
    )
    args = parser.parse_args(argv)
    decoding = checked_decoding(parser, args)
    if not args.manifest.is_file():
        parser.error(f"manifest {args.manifest}: file not found")
    try:  # a teacher's guesses scored as the truth measure nothing
        refuse_pseudo_labels(args.manifest, "manifest")
    except ManifestError as e:
        return fail(str(e))
    setup_logging()
    # The audio files evaluate_manifest decodes, as it resolves them: checked before any is decoded.
    refuse_unsafe_outputs(parser, {"--output": args.output, "--report": args.report},
                          [*decoding_inputs(args.checkpoint, decoding), args.manifest,
                           *manifest_audio(args.manifest)])
    try:
        recognizer = load_recognizer(args.checkpoint, decoding)
        resolved = recognizer.settings(decoding)
        result = evaluate_manifest(recognizer, args.manifest, decoding)
    except (CheckpointError, ManifestError, RuntimeError, ValueError) as e:
        return fail(f"{args.checkpoint}: {e}" if isinstance(e, ValueError) else str(e))

    try:
        if args.output:
            write_output(args.output, "".join(json.dumps(u.to_json(), ensure_ascii=False) + "\n"
                                              for u in result.utterances))
        if args.report:
            write_output(args.report, markdown_report(result, str(args.checkpoint), args.worst))
    except OutputError as e:  # a full disk, say: the old file is left whole
        return fail(str(e))
    w, c = result.words, result.chars
    if result.utterances:
        print(f"{len(result.utterances)} utterances, {result.audio_seconds / 60:.1f} min, "
              f"method {decoding_name(resolved, result.long_inputs)}, "
              f"real-time factor {result.rtf:.3f}")
        print(
            f"WER {100 * w.rate:.2f}% ({w.substitutions} sub, {w.deletions} del, {w.insertions} ins"
            f" / {w.length} words)"
        )
        print(
            f"CER {100 * c.rate:.2f}% ({c.substitutions} sub, {c.deletions} del, {c.insertions} ins"
            f" / {c.length} chars)"
        )
    else:
        print(f"no utterance of {args.manifest} could be scored")
    if result.utterances and args.worst > 0:
        print(f"worst {min(args.worst, len(result.utterances))}:")
        for u in result.worst(args.worst):
            print(
                f"  {u.where}  WER {100 * u.words.rate:.0f}%\n    ref: {u.reference}\n    hyp:"
                f" {u.hypothesis}"
            )
    if result.failed:
        print(
            f"{len(result.failed)} rows not scored:",
            *(f"{w}: {why}" for w, why in result.failed),
            sep="\n  ",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
