"""What the decoding tools share: the checkpoint argument, the ``DecodingConfig`` their flags make
(``decoding.settings``: each tool names the fields it takes, and every flag's help, default and
check is written there once), loading the recognizer, and the method's name for the summary line.

The CTC weight of decoding is ``--decode_ctc_weight`` in every tool, apart from training's
``--ctc_weight``, the weight of the CTC loss; ``--ctc_weight`` here, its removed spelling, is
refused in one line naming ``--decode_ctc_weight``.
"""
from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

from ..checkpoint import checkpoint_file_error
from ..config import ConfigError
from ..decoding.recognizer import Recognizer
from ..decoding.search import LONG_INPUT_METHOD, LONG_INPUT_SECONDS
from ..decoding.settings import DecodingConfig, add_decoding_flags, decoding_config_from_args
from . import Parser

__all__ = ["add_decoding_args", "checked_decoding", "decoding_inputs", "decoding_name",
           "load_recognizer"]


def add_decoding_args(parser: argparse.ArgumentParser, fields: Iterable[str]) -> None:
    """The checkpoint argument and the flags of the ``DecodingConfig`` fields ``fields``."""
    parser.add_argument("checkpoint", type=Path,
                        help="a step checkpoint, latest.pt, best.pt or an average")
    add_decoding_flags(parser, fields)


def checked_decoding(parser: Parser, args: argparse.Namespace, streams: bool | None = False
                     ) -> DecodingConfig:
    """The flags' ``DecodingConfig``, checked before the model is loaded (one line, exit 2):
    ``DecodingConfig.check`` with ``streams`` as it says, and the checkpoint is a file."""
    if why := checkpoint_file_error(args.checkpoint):
        parser.error(why)
    decoding = decoding_config_from_args(args)
    try:
        decoding.check(streams)
    except ConfigError as e:
        parser.error(str(e))
    return decoding


def decoding_inputs(checkpoint: Path, decoding: DecodingConfig) -> list[Path]:
    """The files every decoding run reads: the checkpoint, the LM."""
    return [checkpoint, *([Path(decoding.lm)] if decoding.lm is not None else [])]


def load_recognizer(checkpoint: Path, decoding: DecodingConfig) -> Recognizer:
    return Recognizer.from_checkpoint(checkpoint, decoding.device, lm=decoding.lm)


def decoding_name(d: DecodingConfig, long_inputs: int = 0) -> str:
    """The method of resolved settings ``d`` and their fusion, for the summary line, and how many of
    the inputs were too long for it (decoded with ``LONG_INPUT_METHOD``)."""
    fusion = f" + LM {d.lm} at {d.lm_weight:g}" if d.lm is not None else ""
    name = d.method + fusion + (f", length bonus {d.length_bonus:g}" if d.length_bonus else "")
    if not long_inputs:
        return name
    return name + f" ({long_inputs} over {LONG_INPUT_SECONDS:g} s with {LONG_INPUT_METHOD})"
