"""Synthesize the Konkani demo speech corpus with espeak-ng (``konkanivani-demo-corpus``; see
konkanivani/datatools/corpus.py).

    konkanivani-demo-corpus --output_dir OUT_DIR [--seed 0] [--num_utterances 4800] [--max_sentences
        N] [--jobs 2] [--sentences PATH] [--train_from_text N] [--festival_share F]
        [--prosody_variety] [--force]
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from ..config import DEFAULT_SEED
from ..datatools.corpus import (
    DEFAULT_FESTIVAL_SHARE,
    DEFAULT_SENTENCES,
    DEFAULT_TRAIN_FROM_TEXT,
    FESTIVAL_TRAIN_VOICES,
    EspeakMissingError,
    default_options,
    festival_train_voices,
    make_corpus,
    print_summary,
)
from . import Parser, add_output_dir, fail, output_dir, setup_logging, tool


@tool
def main(argv: Optional[list[str]] = None) -> int:
    setup_logging()
    p = Parser(description=__doc__.split("\n\n")[0])
    add_output_dir(p, "where the corpus goes (its manifests, wavs/, text.txt)", old_positional=True)
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="default: %(default)s")
    p.add_argument("--num_utterances", type=int, default=4800)
    p.add_argument("--max_sentences", type=int, default=None,
                   help="use only the first N sentences after a seeded shuffle")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--sentences", type=Path, default=None, help=f"default: {DEFAULT_SENTENCES}")
    p.add_argument(
        "--train_from_text",
        type=int,
        default=None,
        metavar="N",
        help=(
            "also read N of the text-only sentences (a seeded choice) in the training split, for"
            " more distinct training sentences; text.txt keeps the rest, valid and test are"
            f" unchanged (default: {DEFAULT_TRAIN_FROM_TEXT}; 0 with --sentences or"
            " --max_sentences)"
        ),
    )
    p.add_argument(
        "--festival_share",
        type=float,
        default=None,
        metavar="F",
        help=(
            "read this share of the training utterances with festival's voices of other languages"
            " (Czech, Finnish, Italian, Catalan, US English) instead of espeak-ng; valid, test and"
            f" heldout are unchanged (default: {DEFAULT_FESTIVAL_SHARE} when all"
            f" {len(FESTIVAL_TRAIN_VOICES)} voices are installed, else 0)"
        ),
    )
    p.add_argument("--prosody_variety", action="store_true", help=(
        "give each training utterance espeak-ng reads its own intonation range (30-200%% of the"
        " voice's) and pause between words (0-40 ms); valid, test, heldout and festival's readings"
        " are unchanged"))
    p.add_argument("--force", action="store_true", help="regenerate even if present")
    a = p.parse_args(argv)
    output_dir(p, a)
    for name in ("num_utterances", "jobs", "max_sentences"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            p.error(f"--{name} must be a positive integer, got {getattr(a, name)}")
    if a.train_from_text is not None and a.train_from_text < 0:
        p.error(f"--train_from_text must be 0 or more, got {a.train_from_text}")
    if a.festival_share is None and not default_options()["festival_share"]:
        missing = sorted(set(FESTIVAL_TRAIN_VOICES) - set(festival_train_voices()))
        print(
            f"festival's training voices missing: {', '.join(missing)}"
            " (training_scripts/setup_env.sh installs them); espeak-ng reads the whole training"
            " split"
        )
    if a.festival_share is not None and not 0 <= a.festival_share <= 1:
        p.error(f"--festival_share must be between 0 and 1, got {a.festival_share}")
    if a.sentences is not None and not a.sentences.is_file():
        p.error(f"--sentences {a.sentences}: file not found")
    try:
        summary = make_corpus(
            a.output_dir,
            a.seed,
            a.num_utterances,
            a.max_sentences,
            a.jobs,
            a.sentences,
            a.force,
            train_from_text=a.train_from_text,
            festival_share=a.festival_share,
            prosody=a.prosody_variety,
        )
    except (EspeakMissingError, ValueError) as e:
        return fail(str(e))
    print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
