"""The command-line tools, installed as console scripts (``konkanivani-train`` and the others,
see pyproject.toml) and callable as ``python -m konkanivani.cli.NAME``; the files in
``training_scripts/`` call the same ``main`` functions.

The conventions every tool keeps, all here:

- one logging setup (``setup_logging``): progress and warnings on stderr, timestamped;
- one error path (``fail``): an unusable input or flag is one line, ``error: ...``, exit status 2
  (the parser's own errors are one line too, ``Parser``);
- Ctrl-C ends any tool with one line and exit status 130 (128 + SIGINT), never a traceback
  (``tool``; the console scripts start in ``scripts``, which covers their imports too);
- an output folder is ``--output_dir``, an output file ``--output``; no tool writes over its own
  input, however it names it (``refuse_unsafe_outputs``), and an output appears whole or not at all
  (``datatools.outputs``); ``--seed`` defaults to ``config.DEFAULT_SEED``;
- a removed spelling of a flag is refused in one line that names the flag to use
  (``config.Removed``; CHANGELOG.md lists them).
"""
from __future__ import annotations

import argparse
import functools
import logging
import signal
import sys
from pathlib import Path
from typing import Callable, NoReturn

__all__ = ["Parser", "add_output_dir", "fail", "output_dir", "refuse_unsafe_outputs",
           "setup_logging", "tool"]

log = logging.getLogger("konkanivani")

Main = Callable[[list[str] | None], int]


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (``prog: error: ... (see --help)``), exit 2,
    rather than the whole usage before the error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class _Stderr(logging.StreamHandler):
    """A handler that writes to the ``sys.stderr`` of the moment (a test's capture, say)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


class _Format(logging.Formatter):
    """``HH:MM:SS LEVEL message``; an error reads ``error: message``, the one form every tool's
    unusable input takes."""

    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        return (
            f"error: {record.getMessage()}"
            if record.levelno >= logging.ERROR
            else super().format(record)
        )


def setup_logging() -> None:
    """The one logging setup of every tool: konkanivani's log (and library warnings) on stderr at
    INFO. Records still propagate, so an application's or a test's own handlers see them too."""
    # library warnings as log lines: above a progress bar, and in train.log
    logging.captureWarnings(True)
    for name in ("konkanivani", "py.warnings"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        if not any(isinstance(h, _Stderr) for h in logger.handlers):
            handler = _Stderr()
            handler.setFormatter(_Format())
            logger.addHandler(handler)


def add_output_dir(
    parser: argparse.ArgumentParser, help: str, old_positional: bool = False
) -> None:
    """``--output_dir``, the one name of an output folder; with ``old_positional`` a positional
    OUT_DIR, the removed spelling, is refused in one line naming ``--output_dir`` (``output_dir``).
    """
    parser.add_argument("--output_dir", type=Path, help=help)
    if old_positional:
        parser.add_argument(
            "old_output_dir", nargs="?", type=Path, metavar="OUT_DIR", help=argparse.SUPPRESS
        )


def output_dir(parser: Parser, args: argparse.Namespace) -> Path:
    """The output folder of ``add_output_dir``'s flags, required; stored in ``args.output_dir``."""
    old = getattr(args, "old_output_dir", None)
    if old is not None:
        parser.error(f"the output folder is now given as --output_dir {old}")
    if args.output_dir is None:
        parser.error("the following arguments are required: --output_dir")
    return args.output_dir


def fail(message: str) -> int:
    """Report an unusable input in one line (``error: message`` on stderr, and in the run's log
    where there is one); returns the exit status for it, 2."""
    if any(isinstance(h, _Stderr) for h in log.handlers):
        log.error("%s", message)
    else:  # a tool's main called without setup_logging (a library caller): still one line
        print(f"error: {message}", file=sys.stderr)
    return 2


def refuse_unsafe_outputs(parser: Parser, outputs, reads=(), folders=None) -> None:
    """``datatools.outputs.check_outputs``: a tool never rewrites its own input, nor one output with
    another; the refusal is one line of ``parser`` (exit 2), before any work."""
    # Imported here: the package itself stays free of torch, so that the console scripts
    # (cli/scripts.py) handle Ctrl-C before the slow imports.
    from ..datatools.outputs import OutputError, check_outputs

    try:
        check_outputs(outputs, reads, folders)
    except OutputError as e:
        parser.error(str(e))


def tool(main: Main) -> Main:
    """A tool's ``main``, with Ctrl-C (``KeyboardInterrupt``) ending it in one line on stderr and
    exit status 130, as a shell reports a process ended by SIGINT. Whatever the tool was writing
    is left as its own code leaves it on an exception (the data tools: the previous result)."""
    spec = main.__globals__.get("__spec__")  # python -m konkanivani.cli.<name> runs it as __main__
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
