"""Check every row of a manifest the way training does, name each bad row, optionally write a
cleaned copy (``konkanivani-validate``).

    konkanivani-validate data/demo/train.jsonl --output train.clean.jsonl

Each row is decoded in full (training reads only the audio header at start-up). Errors (the row
would be skipped in training) and warnings (16 kHz / mono conversion, which training does) are
listed with the manifest's path and line; a summary counts them by reason. The cleaned manifest
holds the good rows, their relative audio paths rewritten when it goes to another folder; it may
be no file the run reads (the manifest, the tokenizer, an audio file a row names), and appears
whole when the run ends (written through a temporary file, its missing folders made). Exit
status: 0 when no row has an error, 1 otherwise, 2 when the manifest cannot be read at all (a
missing file, or no line of it a JSON object: a CSV, say).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path

from ..config import DEFAULT_DURATION_TOLERANCE, DEFAULT_MAX_DURATION, DEFAULT_VOCAB_SIZE
from ..data.manifest import ManifestError, check_row, iter_manifest, manifest_audio
from ..data.tokenizer import Tokenizer, train_tokenizer
from ..datatools.outputs import OutputError, write_output
from . import Parser, fail, refuse_unsafe_outputs, setup_logging, tool

_NOT_JSON = "not a JSON object line"
_MANIFEST_FORMAT = (
    'a NeMo manifest holds one JSON object a line: {"audio_filepath": ..., "duration": ..., "text":'
    " ...}"
)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Parser]:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("manifest", type=Path)
    p.add_argument("--output", type=Path, help="write the good rows here (JSON lines)")
    p.add_argument(
        "--tokenizer",
        type=Path,
        help=(
            "SentencePiece .model to check the text against (default: "
            "train one on the manifest, as training does, so only unusable text is found)"
        ),
    )
    p.add_argument("--vocab_size", type=int, default=DEFAULT_VOCAB_SIZE,
                   help=f"vocabulary size when training one (default: {DEFAULT_VOCAB_SIZE})")
    p.add_argument("--max_duration", type=float, default=DEFAULT_MAX_DURATION,
                   help=f"longest audio in seconds (default: {DEFAULT_MAX_DURATION})")
    p.add_argument(
        "--duration_tolerance",
        type=float,
        default=DEFAULT_DURATION_TOLERANCE,
        help=(
            "seconds a row's 'duration' may differ from its file's (<0: don't compare; default: "
            f"{DEFAULT_DURATION_TOLERANCE})"
        ),
    )
    p.add_argument(
        "--strict", action="store_true", help="treat audio that is not 16 kHz mono as an error"
    )
    p.add_argument("--quiet", action="store_true", help="print only the summary")
    args = p.parse_args(argv)
    if not args.manifest.is_file():
        p.error(f"manifest {args.manifest}: file not found")
    if args.tokenizer is not None and not args.tokenizer.is_file():
        p.error(f"--tokenizer {args.tokenizer}: file not found")
    if args.vocab_size < 1 or args.max_duration <= 0:
        p.error("--vocab_size must be a positive integer" if args.vocab_size < 1 else
                "--max_duration must be a positive number of seconds")
    return args, p


def _rebased(row: dict, source_dir: Path, target_dir: Path) -> dict:
    """The row with a relative audio path made relative to ``target_dir`` (absolute paths stay)."""
    audio = Path(row["audio_filepath"])
    if audio.is_absolute() or source_dir.resolve() == target_dir.resolve():
        return row
    return {
        **row,
        "audio_filepath": os.path.relpath((source_dir / audio).resolve(), target_dir.resolve()),
    }


@tool
def main(argv: list[str] | None = None) -> int:
    setup_logging()
    args, parser = parse_args(argv)
    try:
        lines = list(iter_manifest(args.manifest))
    except ManifestError as e:
        return fail(str(e))
    # The cleaned copy may be none of the files checked: the manifest, the tokenizer, every row's
    # audio. Refused before any row is decoded.
    tokenizer = [args.tokenizer] if args.tokenizer else []
    reads = [args.manifest, *tokenizer, *manifest_audio(args.manifest)]
    refuse_unsafe_outputs(parser, {"--output": args.output}, reads)
    not_json = [(line_no, row) for line_no, row in lines if isinstance(row, ManifestError)]
    if lines and len(not_json) == len(lines):  # a CSV, a TSV, a list of paths: no row to check
        return fail(
            f"{args.manifest}: none of its {len(lines)} lines is a JSON object (line"
            f" {not_json[0][0]}: {str(not_json[0][1]).split(': ', 1)[-1].split(';')[0]});"
            f" {_MANIFEST_FORMAT}"
        )
    if args.tokenizer:
        tokenizer = Tokenizer.load(args.tokenizer)
    else:
        texts = [row.get("text") for _, row in lines if isinstance(row, dict)]
        try:
            tokenizer = train_tokenizer([t for t in texts if isinstance(t, str)], args.vocab_size)
        except ValueError as e:
            return fail(f"{args.manifest}: {e}")

    errors, warnings, good = Counter(), Counter(), []
    if not_json:  # said once, with the count and where
        errors[_NOT_JSON] += len(not_json)
        shown = ", ".join(str(n) for n, _ in not_json[:10]) + (" ..." if len(not_json) > 10 else "")
        print(f"ERROR {args.manifest}: {len(not_json)} of {len(lines)} lines not JSON objects "
              f"(line{'s' if len(not_json) > 1 else ''} {shown}); {_MANIFEST_FORMAT}")
    for line_no, row in lines:
        if isinstance(row, ManifestError):
            continue
        where = f"{args.manifest}:{line_no}"
        check = check_row(
            row,
            args.manifest.parent,
            tokenizer,
            max_duration=args.max_duration,
            duration_tolerance=args.duration_tolerance,
            decode=True,
            strict=args.strict,
        )
        for reason, detail in check.warnings:
            warnings[reason] += 1
            if not args.quiet:
                print(f"warning {where}: {reason} ({detail})")
        if check.error is not None:
            reason, detail = check.error
            errors[reason] += 1
            if not args.quiet:
                print(f"ERROR {where}: {reason}" + (f" ({detail})" if detail else ""))
        else:
            good.append(row)

    total = len(lines)
    print(f"{args.manifest}: {total} rows, {len(good)} good, {total - len(good)} with errors, "
          f"{sum(warnings.values())} warnings")
    for label, counts in (("error", errors), ("warning", warnings)):
        for reason, n in counts.most_common():
            print(f"  {n:6d} {label}: {reason}")
    if args.output:
        text = "".join(
            json.dumps(_rebased(row, args.manifest.parent, args.output.parent), ensure_ascii=False)
            + "\n"
            for row in good
        )
        try:
            write_output(args.output, text)  # a kill leaves the old file or the new one
        except OutputError as e:
            return fail(str(e))
        print(f"wrote {len(good)} good rows to {args.output}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
