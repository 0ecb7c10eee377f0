"""Export a checkpoint's encoder and CTC head as ONNX and/or TorchScript, with its vocabulary and
feature settings, for decoding without konkanivani (``konkanivani-export``).

    konkanivani-export checkpoints/run/best.pt --output_dir exported/ --format both

Writes into the output folder ``model.onnx`` and/or ``model.torchscript.pt`` (``features`` (B, T,
n_mels) float32 log-mel and ``feature_lengths`` (B,) int64 in; ``log_probs`` (B, T', V) and
``log_prob_lengths`` (B,) out), ``vocabulary.json`` and ``features.json``. The folder is made
whole beside it and swapped in, so it holds this export alone: an earlier export there is replaced
(its streaming files too), and a folder holding files no export writes is refused. Each model
file is run once written and compared with the checkpoint's model. ONNX needs the ``export``
extra: pip install 'konkanivani[export]'.

    konkanivani-export checkpoints/run/best.pt --output_dir exported/ --streaming --chunk_size 16
    --left_chunks 4

``--streaming`` (a model trained with --causal_conv) also writes ``encoder_chunk.onnx``, which
encodes a stream one chunk of ``--chunk_size`` encoder frames at a time with caches of
``--left_chunks`` chunks, and ``streaming.json``, how to feed it (docs/decoding.md).

    konkanivani-export checkpoints/run/best.pt --streaming --quantize int8

``--quantize int8`` writes int8 ONNX graphs under the same names (by default into the checkpoint's
path without .pt plus _export_int8): onnxruntime's dynamic quantization of the linear layers'
weights, the convolutions left float, each graph checked against the float one on the same input.
The folder is served and loaded as any export (docs/decoding.md, "int8").

    konkanivani-export checkpoints/run/best.pt --format sherpa-onnx --output_dir sherpa/

``--format sherpa-onnx`` writes a folder for sherpa-onnx's WeNet CTC recognizer instead: model.onnx
with the metadata it reads, tokens.txt and a README (docs/deployment.md); for a model trained with
--causal_conv also model-streaming.onnx, for its online recognizer, in chunks of 16 frames with 4
left chunks unless --streaming --chunk_size/--left_chunks say otherwise. It needs a model trained
with --frontend kaldi_fbank, the features sherpa-onnx computes; another is refused in one line.
"""
from __future__ import annotations

import sys
from pathlib import Path

from ..checkpoint import CheckpointError, checkpoint_file_error
from ..config import ConfigError, Removed
from ..decoding.model_export import (
    FILES,
    FORMATS,
    INT8_TOLERANCE,
    QUANTIZATIONS,
    SHERPA_FILES,
    STREAMING_FILES,
    ExportError,
    Streaming,
    export_checkpoint,
    foreign_files,
    unavailable,
)
from ..decoding.settings import add_decoding_flags, decoding_config_from_args
from ..decoding.sherpa_export import SHERPA_FORMAT, export_sherpa_onnx
from . import Parser, fail, refuse_unsafe_outputs, setup_logging, tool

# The DecodingConfig fields konkanivani-export takes as flags (docs/generate_flags.py reads them):
# the chunks of --streaming.
DECODING_FIELDS = ("chunk_size", "left_chunks")


@tool
def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.quantize and args.format != "onnx":
        parser.error(f"--quantize {args.quantize} quantizes the ONNX graphs: it goes with --format "
                     f"onnx (the default), not --format {args.format}")
    if not args.streaming and (args.chunk_size is not None or args.left_chunks is not None):
        parser.error("--chunk_size and --left_chunks go with --streaming")
    decoding = decoding_config_from_args(args)
    try:
        decoding.check(streams=True)
    except ConfigError as e:
        parser.error(str(e))
    streaming = _streaming(parser, args, decoding)
    if why := checkpoint_file_error(args.checkpoint):
        parser.error(why)
    suffix = f"_export_{args.quantize}" if args.quantize else "_export"
    output = args.output_dir or args.checkpoint.with_name(f"{args.checkpoint.stem}{suffix}")
    if output.exists() and not output.is_dir():
        parser.error(f"--output_dir {output}: exists and is not a folder")
    sherpa = args.format == SHERPA_FORMAT
    formats = FORMATS if args.format == "both" else ("onnx",) if sherpa else (args.format,)
    if reason := unavailable((*formats, "onnx") if streaming else formats):
        return fail(reason)
    # Each file the export replaces, none of which may be the checkpoint it reads.
    names = [FILES[f] for f in formats] + [FILES["vocabulary"], FILES["features"]]
    names += list(STREAMING_FILES.values()) if streaming else []
    names = list(SHERPA_FILES.values()) if sherpa else names
    flag = "--output_dir" if args.output_dir else "the export"
    refuse_unsafe_outputs(parser, [(flag, output / name) for name in names], [args.checkpoint],
                          folders={flag: output})
    # the folder is replaced whole: one holding anything else is refused
    if foreign := foreign_files(output):
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        parser.error(f"{flag} {output} holds {foreign[0]}{more}, which no export writes: an export "
                     "replaces the whole folder; move it away or choose another folder")
    setup_logging()
    try:
        if sherpa:
            written = export_sherpa_onnx(args.checkpoint, output, streaming)
        else:
            written = export_checkpoint(args.checkpoint, output, formats, streaming,
                                        args.quantize)
    except (CheckpointError, ExportError) as e:
        return fail(str(e))
    # the folder cannot be made or written to: under a file, read-only, a full disk
    except OSError as e:
        return fail(f"cannot write the export to {output}: {e.strerror or e}")
    for item in written:
        print(f"wrote {item.path}{_checked(item)}")
    return 0


def _parser() -> Parser:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "checkpoint", type=Path, help="a step checkpoint, latest.pt, best.pt or an average"
    )
    parser.add_argument(
        "--output_dir",
        type=Path,
        help="output folder (default: the checkpoint's path without .pt, plus _export)",
    )
    parser.add_argument("-o", "--output", action=Removed, new="--output_dir")
    parser.add_argument(
        "--format", choices=(*FORMATS, "both", "sherpa-onnx"), default="onnx",
        help=("default: %(default)s; sherpa-onnx: a folder for sherpa-onnx's WeNet CTC recognizer"
              " (a model trained with --frontend kaldi_fbank)")
    )
    parser.add_argument(
        "--streaming",
        action="store_true",
        help=(
            "also write encoder_chunk.onnx, one chunk of a stream with its caches, and"
            " streaming.json (a model trained with --causal_conv)"
        ),
    )
    parser.add_argument(
        "--quantize",
        choices=QUANTIZATIONS,
        help=(
            "write int8 ONNX graphs (onnxruntime dynamic quantization of the linear layers; the"
            " convolutions stay float): smaller and faster on CPUs; with --format onnx; default"
            " folder: the checkpoint's path without .pt, plus _export_int8"
        ),
    )
    add_decoding_flags(parser, DECODING_FIELDS)
    return parser


def _streaming(parser: Parser, args, decoding) -> Streaming | None:
    """With --streaming, the chunk graph's settings; a bad one is one line of ``parser``."""
    if not args.streaming:
        return None
    # Unless given: a stream's chunk, and the left context of an export's caches.
    left = decoding.left_chunks
    try:
        return Streaming(decoding.chunk_size or Streaming.chunk_size,
                         Streaming.left_chunks if left == -1 else left)
    except ValueError as e:  # the caches hold at least one chunk
        parser.error(f"--{e}")


def _checked(item) -> str:
    """What the export checked of a written file, for its line: its difference from PyTorch, or
    from the float graph for an int8 graph (with its size)."""
    chunked = item.path.name == STREAMING_FILES["onnx"]
    if item.quantization is not None:
        size = item.path.stat().st_size
        return (f" ({item.quantization}, {size / 1e6:.1f} MB, {item.float_bytes / size:.1f}x"
                f" smaller than float; token probabilities within {item.difference:.3f} of the"
                f" float graph's{', chunk by chunk' if chunked else ''}, tolerance"
                f" {INT8_TOLERANCE})")
    if item.difference is None:
        return ""
    if chunked:
        return (f" (log-probs and encoder frames within {item.difference:.1e} of PyTorch's,"
                " chunk by chunk)")
    return f" (log-probs within {item.difference:.1e} of PyTorch's)"


if __name__ == "__main__":
    sys.exit(main())
