"""The console scripts' entry points (pyproject.toml, ``[project.scripts]``). Each imports its
tool with Ctrl-C already handled, so that a Ctrl-C while the tool's modules import (torch takes
seconds) ends it as a Ctrl-C in the tool does (``cli.tool``): one line on stderr and exit status
130, never a traceback. This module, the ``cli`` package and the ``konkanivani`` package import
nothing heavy, so the handling is in place a few milliseconds after Python starts.

While the imports run, SIGINT ends the process at once rather than raising KeyboardInterrupt:
torch's import does not always survive an exception raised anywhere inside it (in tests a
KeyboardInterrupt there was now and then lost, the tool going on to wait for ever, or left the
import hung), and nothing has been written yet that would need cleaning up. The tool itself then
gets Python's KeyboardInterrupt back, which it handles (``cli.tool``; training saves and stops).
"""
from __future__ import annotations

import importlib
import os
import signal
import sys


def _interrupted(name: str) -> int:
    print(f"\n{name}: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
    return 128 + signal.SIGINT


def _run(module: str) -> int:
    name = "konkanivani-" + module.replace("_", "-")
    # Only where Ctrl-C would interrupt: a job started in the background keeps SIGINT ignored.
    handled = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if handled:
        signal.signal(signal.SIGINT, lambda signum, frame: os._exit(_interrupted(name)))
    try:
        main = importlib.import_module(f"{__package__}.{module}").main
        if handled:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        return main()
    except KeyboardInterrupt:  # between the two: the tool's main handles its own
        return _interrupted(name)


def train() -> int:
    return _run("train")


def transcribe() -> int:
    return _run("transcribe")


def evaluate() -> int:
    return _run("evaluate")


def average() -> int:
    return _run("average")


def validate() -> int:
    return _run("validate")


def plan_memory() -> int:
    return _run("plan_memory")


def demo_corpus() -> int:
    return _run("demo_corpus")


def prepare() -> int:
    return _run("prepare")


def plot() -> int:
    return _run("plot")


def export() -> int:
    return _run("export")


def train_lm() -> int:
    return _run("train_lm")


def sweep() -> int:
    return _run("sweep")


def serve() -> int:
    return _run("serve")


def pseudolabel() -> int:
    return _run("pseudolabel")
