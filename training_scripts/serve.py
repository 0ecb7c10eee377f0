#!/usr/bin/env python3
"""Serve a checkpoint over HTTP and WebSocket, with a page to try it (konkanivani-serve); the code
is konkanivani/cli/serve.py. `--help` lists the flags."""
import sys

from konkanivani.cli.serve import main

if __name__ == "__main__":
    sys.exit(main())
