#!/usr/bin/env python3
"""Average checkpoints for decoding (konkanivani-average); the code is konkanivani/cli/average.py.
`--help` lists the flags."""
import sys

from konkanivani.cli.average import main

if __name__ == "__main__":
    sys.exit(main())
