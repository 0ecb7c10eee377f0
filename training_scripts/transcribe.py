#!/usr/bin/env python3
"""Transcribe audio with a checkpoint (konkanivani-transcribe); the code is
konkanivani/cli/transcribe.py. `--help` lists the flags."""
import sys

from konkanivani.cli.transcribe import main

if __name__ == "__main__":
    sys.exit(main())
