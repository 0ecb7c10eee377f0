#!/usr/bin/env python3
"""Sweep trainer flags over a grid (konkanivani-sweep); the code is konkanivani/cli/sweep.py.
`--help` lists the flags."""
import sys

from konkanivani.cli.sweep import main

if __name__ == "__main__":
    sys.exit(main())
