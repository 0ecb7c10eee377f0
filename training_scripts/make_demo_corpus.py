#!/usr/bin/env python3
"""Synthesize the Konkani demo corpus (konkanivani-demo-corpus); the code is
konkanivani/cli/demo_corpus.py. `--help` lists the flags."""
import sys

from konkanivani.cli.demo_corpus import main

if __name__ == "__main__":
    sys.exit(main())
