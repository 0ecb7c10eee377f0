#!/usr/bin/env python3
"""Export a checkpoint as ONNX/TorchScript for decoding without konkanivani (konkanivani-export);
the code is konkanivani/cli/export.py. `--help` lists the flags."""
import sys

from konkanivani.cli.export import main

if __name__ == "__main__":
    sys.exit(main())
