#!/usr/bin/env python3
"""Label untranscribed audio with a teacher checkpoint and keep the confident labels
(konkanivani-pseudolabel); the code is konkanivani/cli/pseudolabel.py. `--help` lists the flags."""
import sys

from konkanivani.cli.pseudolabel import main

if __name__ == "__main__":
    sys.exit(main())
