"""The command-line tools, installed as console scripts (``konkanivani-train`` and the others,
see pyproject.toml) and callable as ``python -m konkanivani.cli.NAME``; the files in
``training_scripts/`` call the same ``main`` functions.

Every tool checks its flags before any work and reports a bad one in one line with exit status 2,
and Ctrl-C ends any of them with one line and exit status 130 (128 + SIGINT), never a traceback
(``tool``).
"""
from __future__ import annotations

import argparse
import functools
import signal
import sys
from pathlib import Path
from typing import Callable, NoReturn

__all__ = ["Parser", "fail", "refuse_writing_inputs", "tool"]

Main = Callable[[list[str] | None], int]


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (``prog: error: ... (see --help)``), exit 2,
    rather than the whole usage before the error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def fail(message: str) -> int:
    """Print ``error: message`` on stderr; the exit status of an unusable input (2)."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def refuse_writing_inputs(parser: Parser, flag: str, output: str | Path | None, inputs: list[str | Path]) -> None:
    """A tool never rewrites its own input: ``flag``'s file may not be one of ``inputs`` (one line, exit 2)."""
    if output is None:
        return
    target = Path(output).resolve()
    for given in inputs:
        if Path(given).resolve() == target:
            parser.error(f"{flag} {output} is also an input of this command: a tool never rewrites its own input; "
                         "write to another file")


def tool(main: Main) -> Main:
    """A tool's ``main``, with Ctrl-C (``KeyboardInterrupt``) ending it in one line on stderr and
    exit status 130, as a shell reports a process ended by SIGINT. Whatever the tool was writing
    is left as its own code leaves it on an exception (the data tools: the previous result)."""
    spec = main.__globals__.get("__spec__")  # python -m konkanivani.cli.NAME runs it as __main__
    module = spec.name if spec is not None else main.__module__
    name = "konkanivani-" + module.rsplit(".", 1)[-1].replace("_", "-")

    @functools.wraps(main)
    def run(argv: list[str] | None = None) -> int:
        try:
            return main(argv)
        except KeyboardInterrupt:
            print(f"\n{name}: interrupted (Ctrl-C)", file=sys.stderr)
            return 128 + signal.SIGINT
    return run
