#!/usr/bin/env python3
"""Synthesize the Konkani demo speech corpus with espeak-ng (see konkanivani/demo_corpus.py).

Usage: python training_scripts/make_demo_corpus.py OUT_DIR [--seed 0]
           [--num_utterances 4800] [--max_sentences N] [--jobs 2] [--sentences PATH] [--force]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from konkanivani.demo_corpus import DEFAULT_SENTENCES, EspeakMissingError, make_corpus, print_summary  # noqa: E402


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num_utterances", type=int, default=4800)
    p.add_argument("--max_sentences", type=int, default=None,
                   help="use only the first N sentences after a seeded shuffle")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--sentences", type=Path, default=None, help=f"default: {DEFAULT_SENTENCES}")
    p.add_argument("--force", action="store_true", help="regenerate even if present")
    a = p.parse_args(argv)
    try:
        summary = make_corpus(a.out_dir, a.seed, a.num_utterances, a.max_sentences,
                              a.jobs, a.sentences, a.force)
    except EspeakMissingError as e:
        sys.exit(f"error: {e}")
    print_summary(summary)


if __name__ == "__main__":
    main()
