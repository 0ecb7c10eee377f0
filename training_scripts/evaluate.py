#!/usr/bin/env python3
"""Score a checkpoint on a manifest (konkanivani-evaluate); the code is konkanivani/cli/evaluate.py.
`--help` lists the flags."""
import sys

from konkanivani.cli.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
