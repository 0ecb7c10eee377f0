#!/usr/bin/env python3
"""Plan a run that fits a GPU (konkanivani-plan-memory); the code is konkanivani/cli/plan_memory.py.
`--help` lists the flags."""
import sys

from konkanivani.cli.plan_memory import main

if __name__ == "__main__":
    sys.exit(main())
