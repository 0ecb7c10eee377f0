#!/usr/bin/env python3
"""Draw or compare the learning curves of training runs (konkanivani-plot); the code is
konkanivani/cli/plot.py. `--help` lists the flags."""
import sys

from konkanivani.cli.plot import main

if __name__ == "__main__":
    sys.exit(main())
