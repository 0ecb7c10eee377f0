"""Write NeMo manifests (train.jsonl, valid.jsonl, test.jsonl) from a Common Voice release, a Kaldi
data directory, a folder of audio with .txt transcripts or a saved Hugging Face dataset
(``konkanivani-prepare``; the code is konkanivani/datatools/importers.py).

    konkanivani-prepare commonvoice CV_DIR --output_dir OUT_DIR [--convert wav] konkanivani-prepare
    kaldi DATA_DIR --output_dir OUT_DIR [--audio_root DIR] [--split_name train] [--valid_fraction
    0.1] konkanivani-prepare folder AUDIO_DIR --output_dir OUT_DIR [--split_name train]
    [--valid_fraction 0.1] konkanivani-prepare hf DATASET_DIR --output_dir OUT_DIR [--text_column
    sentence] [--valid_fraction 0.1] konkanivani-prepare shards MANIFEST --output_dir SHARD_DIR
    (--shard_size N | --shard_hours H)

``shards`` writes a manifest's utterances as tar shards for ``--train_shards``
(konkanivani/datatools/shard_writer.py; docs/data.md): a Drive mount or several machines read them
far faster than one file per utterance.

Each row is checked as konkanivani-validate checks it; the rows that cannot be used are counted by
reason at the end, the first few named with file and line. Exit status: 0 when a manifest was
written, 1 when no row could be used, 2 when the source cannot be read at all or OUT_DIR is or
contains it, 130 on Ctrl-C (the previous manifests and audio stay as they were).
"""
from __future__ import annotations

import sys
from pathlib import Path

from ..checkpoint import CheckpointError
from ..config import DEFAULT_MAX_DURATION, DEFAULT_SEED, Removed
from ..data.manifest import ManifestError, manifest_audio
from ..data.shards import AUDIO_MEMBER, AUDIO_MEMBERS
from ..data.tokenizer import Tokenizer
from ..datatools.importers import (
    CONVERT_FORMATS,
    PrepareError,
    commonvoice_items,
    folder_items,
    hf_items,
    kaldi_items,
    prepare,
    print_report,
)
from ..datatools.outputs import OutputError, child, refuse_overlap
from ..datatools.shard_writer import print_shard_report, write_shards
from . import Parser, add_output_dir, fail, output_dir, refuse_unsafe_outputs, setup_logging, tool


def parse_args(argv: list[str] | None = None):
    p = Parser(description=__doc__.split("\n\n")[0])
    sources = p.add_subparsers(
        dest="source",
        required=True,
        metavar="SOURCE",
        help="commonvoice, kaldi, folder or hf (each has its own --help); or shards",
    )
    metavars = {
        "commonvoice": "CV_DIR",
        "kaldi": "DATA_DIR",
        "folder": "AUDIO_DIR",
        "hf": "DATASET_DIR",
    }
    helps = {
        "commonvoice": "a Common Voice release folder: train.tsv, dev.tsv, test.tsv and clips/",
        "kaldi": "a Kaldi data directory: wav.scp, text, optional segments and utt2spk",
        "folder": "a folder of audio files with same-named .txt transcripts (searched recursively)",
        "hf": (
            "a Hugging Face datasets audio dataset saved with save_to_disk (pip install"
            " 'konkanivani[hf]')"
        ),
    }
    for name, text in helps.items():
        _importer_parser(sources, name, text, metavars[name])
    _shards_parser(sources)
    args = p.parse_args(argv)
    sub = sources.choices[args.source]
    if args.source == "shards":
        return _check_shards_args(sub, args)
    args.out_dir = output_dir(sub, args)
    if not args.source_dir.is_dir():
        sub.error(f"{args.source_dir}: not a folder")
    _check_row_check_flags(sub, args)
    if not 0 <= getattr(args, "valid_fraction", 0.0) < 1:
        sub.error(f"--valid_fraction must be at least 0 and below 1, got {args.valid_fraction}")
    try:
        refuse_overlap(args.source_dir, args.out_dir, f"the source {metavars[args.source]}")
        if hasattr(args, "split_name"):
            child(args.out_dir, args.split_name, "--split_name")
    except OutputError as e:
        sub.error(str(e))
    return args


def _importer_parser(sources, name: str, text: str, metavar: str) -> None:
    """The subcommand of importer ``name`` (its ``--help`` is ``text``)."""
    s = sources.add_parser(name, help=text, description=text)
    s.add_argument("source_dir", type=Path, metavar=metavar)
    add_output_dir(s, "where the manifests (and any audio written) go", old_positional=True)
    s.add_argument(
        "--convert",
        choices=CONVERT_FORMATS,
        help="decode the audio to 16 kHz mono files of this format under OUT_DIR"
        + (
            " (always done here; default: wav)"
            if name == "hf"
            else (
                " (Kaldi segments are always cut to files; default: wav)"
                if name == "kaldi"
                else ""
            )
        ),
    )
    _add_row_check_flags(s)
    s.add_argument("--no-progress", action=Removed, new="--no_progress")
    if name != "commonvoice":
        s.add_argument(
            "--split_name",
            default="train",
            help="the manifest's name (default: train)"
            + (
                "; a dataset with splits keeps their names, validation/dev as valid"
                if name == "hf"
                else ""
            ),
        )
        s.add_argument(
            "--valid_fraction",
            type=float,
            default=0.0,
            help="move this share of the rows, drawn at random, to valid.jsonl (default: 0)",
        )
        s.add_argument(
            "--seed",
            type=int,
            default=DEFAULT_SEED,
            help="seed of that draw (default: %(default)s)",
        )
    if name == "kaldi":
        s.add_argument(
            "--audio_root",
            type=Path,
            default=Path("."),
            help=(
                "folder relative wav.scp paths start from (default: the current one, as in"
                " Kaldi)"
            ),
        )
    if name == "hf":
        s.add_argument(
            "--text_column",
            help="default: sentence, text or transcription, the first that exists",
        )
        s.add_argument("--audio_column", help="default: the dataset's Audio column")


def _add_row_check_flags(s) -> None:
    """The flags every source shares: how rows are checked, and the progress bar."""
    s.add_argument(
        "--tokenizer",
        type=Path,
        help="SentencePiece .model to check the text against (default: characters, the strictest)",
    )
    s.add_argument("--max_duration", type=float, default=DEFAULT_MAX_DURATION,
                   help="skip audio longer than this many seconds (default: "
                        f"{DEFAULT_MAX_DURATION}, as training)")
    s.add_argument("--no_progress", dest="progress", action="store_false", help="no progress bar")


def _check_row_check_flags(sub, args) -> None:
    if args.tokenizer is not None and not args.tokenizer.is_file():
        sub.error(f"--tokenizer {args.tokenizer}: file not found")
    if args.max_duration <= 0:
        sub.error("--max_duration must be a positive number of seconds")


def _shards_parser(sources) -> None:
    text = ("a manifest's utterances as tar shards (KEY.flac or KEY.opus + KEY.json) and their "
            "list, shards.json")
    s = sources.add_parser("shards", help=text, description=text)
    s.add_argument(
        "manifest",
        type=Path,
        metavar="MANIFEST",
        help="the NeMo manifest (JSON lines) to write as shards",
    )
    add_output_dir(s, "where the shards, shards.json and text.txt go")
    size = s.add_mutually_exclusive_group(required=True)
    size.add_argument("--shard_size", type=int, help="utterances per shard")
    size.add_argument("--shard_hours", type=float, help="hours of audio per shard")
    s.add_argument("--audio_format", choices=AUDIO_MEMBERS, default=AUDIO_MEMBER,
                   help="flac: 16-bit, lossless (default); opus: Opus in Ogg, lossy, about a tenth "
                        "of the bytes (a corpus that must travel small)")
    _add_row_check_flags(s)


def _check_shards_args(sub, args):
    args.out_dir = output_dir(sub, args)
    if not args.manifest.is_file():
        sub.error(f"{args.manifest}: manifest not found")
    _check_row_check_flags(sub, args)
    if (args.shard_size is not None and args.shard_size <= 0) or (args.shard_hours is not None
                                                                   and args.shard_hours <= 0):
        sub.error("--shard_size and --shard_hours must be positive")
    # its text.txt could be the corpus's own
    if args.out_dir.resolve() == args.manifest.parent.resolve():
        sub.error(
            f"--output_dir {args.out_dir} is the manifest's folder: shards go in a folder of"
            " their own"
        )
    # Nor may the folder hold any other file the shards are made from: the tokenizer, a row's audio.
    tokenizer = [args.tokenizer] if args.tokenizer else []
    reads = [args.manifest, *tokenizer, *manifest_audio(args.manifest)]
    refuse_unsafe_outputs(sub, {}, reads, folders={"--output_dir": args.out_dir})
    return args


def _items(args):
    if args.source == "commonvoice":
        return commonvoice_items(args.source_dir, args.out_dir, args.convert)
    if args.source == "kaldi":
        return kaldi_items(
            args.source_dir, args.out_dir, args.split_name, args.convert, args.audio_root
        )
    if args.source == "folder":
        return folder_items(args.source_dir, args.split_name, args.convert, args.out_dir)
    return hf_items(
        args.source_dir,
        args.out_dir,
        args.split_name,
        args.text_column,
        args.audio_column,
        args.convert,
    )


@tool
def main(argv: list[str] | None = None) -> int:
    setup_logging()
    args = parse_args(argv)
    if args.source == "shards":
        return _shards(args)
    try:
        items = _items(args)
        report = prepare(
            items,
            args.out_dir,
            tokenizer=Tokenizer.load(args.tokenizer) if args.tokenizer else None,
            max_duration=args.max_duration,
            valid_fraction=getattr(args, "valid_fraction", 0.0),
            split_name=getattr(args, "split_name", "train"),
            seed=getattr(args, "seed", 0),
            progress=args.progress,
        )
    except PrepareError as e:
        return fail(str(e))
    print_report(report)
    return 0 if report.manifests else 1


def _shards(args) -> int:
    try:
        report = write_shards(args.manifest, args.out_dir, shard_size=args.shard_size or 0,
                              shard_hours=args.shard_hours or 0.0,
                              tokenizer=Tokenizer.load(args.tokenizer) if args.tokenizer else None,
                              max_duration=args.max_duration, progress=args.progress,
                              audio_format=args.audio_format)
    except (ManifestError, CheckpointError) as e:
        return fail(str(e))
    print_shard_report(report)
    return 0 if report.shards else 1


if __name__ == "__main__":
    sys.exit(main())
