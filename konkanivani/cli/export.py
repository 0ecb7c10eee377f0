"""Export a checkpoint's encoder and CTC head as ONNX and/or TorchScript, with its vocabulary and
feature settings, for decoding without konkanivani (``konkanivani-export``).

    konkanivani-export checkpoints/run/best.pt --output_dir exported/ --format both

Writes into the output folder ``model.onnx`` and/or ``model.torchscript.pt`` (``features`` (B, T,
n_mels) float32 log-mel and ``feature_lengths`` (B,) int64 in; ``log_probs`` (B, T', V) and
``log_prob_lengths`` (B,) out), ``vocabulary.json`` and ``features.json``; files of the same names
already there are replaced. Each model file is run once written and compared with the checkpoint's
model. ONNX needs the ``export`` extra: pip install 'konkanivani[export]'.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..checkpoint import CheckpointError
from ..config import Renamed
from ..decoding.export import FORMATS, ExportError, export_checkpoint, unavailable
from . import Parser, fail, setup_logging, tool


@tool
def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a step checkpoint, latest.pt, best.pt or an average")
    parser.add_argument("--output_dir", type=Path,
                        help="output folder (default: the checkpoint's path without .pt, plus _export)")
    parser.add_argument("-o", "--output", dest="output_dir", type=Path, action=Renamed, new="--output_dir",
                        help=argparse.SUPPRESS)
    parser.add_argument("--format", choices=(*FORMATS, "both"), default="onnx", help="default: %(default)s")
    args = parser.parse_args(argv)
    if not args.checkpoint.is_file():
        parser.error(f"checkpoint {args.checkpoint}: file not found")
    output = args.output_dir or args.checkpoint.with_name(f"{args.checkpoint.stem}_export")
    if output.exists() and not output.is_dir():
        parser.error(f"--output_dir {output}: exists and is not a folder")
    formats = FORMATS if args.format == "both" else (args.format,)
    if reason := unavailable(formats):
        return fail(reason)
    setup_logging()
    try:
        written = export_checkpoint(args.checkpoint, output, formats)
    except (CheckpointError, ExportError) as e:
        return fail(str(e))
    except OSError as e:  # the folder cannot be made or written to: under a file, read-only, a full disk
        return fail(f"cannot write the export to {output}: {e.strerror or e}")
    for item in written:
        check = "" if item.difference is None else f" (log-probs within {item.difference:.1e} of PyTorch's)"
        print(f"wrote {item.path}{check}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
