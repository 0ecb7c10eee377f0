#!/usr/bin/env python3
"""Check every row of a manifest (konkanivani-validate); the code is konkanivani/cli/validate.py.
`--help` lists the flags."""
import sys

from konkanivani.cli.validate import main

if __name__ == "__main__":
    sys.exit(main())
