#!/usr/bin/env python3
"""Write manifests from Common Voice, Kaldi, a folder of audio + .txt or a saved Hugging Face
dataset (konkanivani-prepare); the code is konkanivani/cli/prepare.py. `--help` lists the flags."""
import sys

from konkanivani.cli.prepare import main

if __name__ == "__main__":
    sys.exit(main())
