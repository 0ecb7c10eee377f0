#!/usr/bin/env python3
"""Train a konkanivani model (konkanivani-train); the code is konkanivani/cli/train.py. `--help`
lists the flags."""
import sys

from konkanivani.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
