"""Score a konkanivani checkpoint on a manifest (``konkanivani-evaluate``): WER and CER with
substitutions, deletions and insertions, the worst utterances, per-utterance JSONL and a markdown report.

    konkanivani-evaluate checkpoints/run/best.pt data/demo/test.jsonl \\
        --method joint --output results.jsonl --report report.md
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..checkpoint import CheckpointError
from ..data.manifest import ManifestError
from ..decoding.evaluation import evaluate_manifest, markdown_report
from . import Parser, fail, refuse_writing_inputs, setup_logging, tool
from .decoding_flags import add_decoding_args, check_decoding_args, decoding_name, load_recognizer


@tool
def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    add_decoding_args(parser)
    parser.add_argument("manifest", type=Path)
    parser.add_argument("--output", help="per-utterance results as JSONL")
    parser.add_argument("--report", help="write a markdown report here")
    parser.add_argument("--worst", type=int, default=10, help="how many of the worst utterances to list")
    args = parser.parse_args(argv)
    check_decoding_args(parser, args)
    refuse_writing_inputs(parser, "--output", args.output, [args.checkpoint, args.manifest])
    refuse_writing_inputs(parser, "--report", args.report, [args.checkpoint, args.manifest])
    if not args.manifest.is_file():
        parser.error(f"manifest {args.manifest}: file not found")
    setup_logging()
    try:
        result = evaluate_manifest(load_recognizer(args), args.manifest, args.method, args.beam_size,
                                   args.decode_ctc_weight, args.batch_size, args.lm_weight, args.length_bonus)
    except (CheckpointError, ManifestError, RuntimeError) as e:
        return fail(str(e))

    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(u.to_json(), ensure_ascii=False) + "\n" for u in result.utterances)
    if args.report:
        Path(args.report).write_text(markdown_report(result, str(args.checkpoint), args.worst), encoding="utf-8")
    w, c = result.words, result.chars
    if result.utterances:
        print(f"{len(result.utterances)} utterances, {result.audio_seconds / 60:.1f} min, "
              f"method {decoding_name(args, result.long_inputs)}, real-time factor {result.rtf:.3f}")
        print(f"WER {100 * w.rate:.2f}% ({w.substitutions} sub, {w.deletions} del, {w.insertions} ins / "
              f"{w.length} words)")
        print(f"CER {100 * c.rate:.2f}% ({c.substitutions} sub, {c.deletions} del, {c.insertions} ins / "
              f"{c.length} chars)")
    else:
        print(f"no utterance of {args.manifest} could be scored")
    if result.utterances and args.worst > 0:
        print(f"worst {min(args.worst, len(result.utterances))}:")
        for u in result.worst(args.worst):
            print(f"  {u.where}  WER {100 * u.words.rate:.0f}%\n    ref: {u.reference}\n    hyp: {u.hypothesis}")
    if result.failed:
        print(f"{len(result.failed)} rows not scored:", *(f"{w}: {why}" for w, why in result.failed),
              sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
