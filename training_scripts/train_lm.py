#!/usr/bin/env python3
"""Train a language model on text for shallow fusion (konkanivani-train-lm); the code is
konkanivani/cli/train_lm.py. `--help` lists the flags."""
import sys

from konkanivani.cli.train_lm import main

if __name__ == "__main__":
    sys.exit(main())
