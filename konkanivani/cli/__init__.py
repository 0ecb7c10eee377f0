"""The command-line tools, installed as console scripts (``konkanivani-train`` and the others,
see pyproject.toml) and callable as ``python -m konkanivani.cli.NAME``; the files in
``training_scripts/`` call the same ``main`` functions.

Every tool checks its flags before any work and reports a bad one in one line with exit status 2.
"""
from __future__ import annotations

import argparse
import sys
from typing import NoReturn

__all__ = ["Parser", "fail"]


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (``prog: error: ... (see --help)``), exit 2,
    rather than the whole usage before the error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def fail(message: str) -> int:
    """Print ``error: message`` on stderr; the exit status of an unusable input (2)."""
    print(f"error: {message}", file=sys.stderr)
    return 2
