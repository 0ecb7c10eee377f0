"""A checkpoint's encoder and CTC head as ONNX and TorchScript files, for decoding without
konkanivani.

An export folder holds::

    model.onnx              ONNX (opset 18), for onnxruntime and other ONNX runtimes
    model.torchscript.pt    TorchScript, for torch.jit.load (C++ libtorch included) vocabulary.json
    token id -> SentencePiece piece, the blank id, how to join pieces into text features.json
    how the log-mel features are made (sample rate, window, hop, mel bins, log)

Both graphs take ``features`` ``(B, T, F)`` float32, log-mel frames exactly as ``features.LogMel``
makes them (CMVN lives in the model, global or per utterance, so it is inside the graph), and
``feature_lengths`` ``(B,)`` int64; they return ``log_probs`` ``(B, T', V)`` float32 CTC
log-probabilities and ``log_prob_lengths`` ``(B,)`` int64. B and T are free (T >= ``MIN_FRAMES``).

ONNX goes through ``torch.export`` (``torch.onnx.export(dynamo=True)``, which needs onnxscript):
it traces with symbolic batch and frame counts and fails at export where a shape would be baked in.
The older TorchScript-based ONNX exporter records Python-level branches on shapes as constants (it
warns and carries on) and is deprecated. TorchScript is ``torch.jit.trace`` of the same module,
frozen so the file holds only the weights the graph uses. Every file is run after it is written on
a batch of other lengths than it was traced with, and compared with the PyTorch model.

For streaming (a model trained with ``causal_conv``), ``export_checkpoint(..., streaming=...)`` also
writes::

    encoder_chunk.onnx      one chunk of a stream: a window of log-mel frames and the caches in,
                            the chunk's CTC log-probabilities, encoder frames and the next caches
                            out
    streaming.json          the chunk size, the window and its hop, the cache shapes, the CMVN mode

With ``quantize="int8"`` (``konkanivani-export --quantize int8``) the ONNX files of the folder are
int8 ones under the same names: each float graph is exported and checked as above, then quantized
by ``quantize_onnx`` (onnxruntime's dynamic quantization of the MatMul weights; the convolutions
stay float), checked against the float graph on the same input (``INT8_TOLERANCE``), and written in
its place. The float graphs are not kept, so an int8 folder is served and loaded as any export is;
each int8 file says so in its ONNX metadata (``quantization``: ``int8``, ``INT8_METADATA``).

``ChunkGraph`` says what it takes and gives. Its caches have a fixed size (``left_chunks`` chunks of
attention keys and values): the offset says how many of them a stream has filled, so one graph runs
every chunk, the first ones and a shorter last one included. It is checked like the others: a
stream of several chunks through onnxruntime against ``ConformerEncoder.forward_chunk``.
"""
from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import logging
import os
import shutil
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint import fsync_dir
from ..data.features import INT16_SCALE, KALDI_FBANK, KALDI_FLOOR, LOG_OFFSET, KaldiFbank, LogMel
from ..data.frames import HOP_LENGTH, SAMPLE_RATE, subsampled_lengths
from ..data.tokenizer import BLANK_ID, SOS_EOS_ID, UNK_ID, Tokenizer
from ..model.asr import ASRModel
from ..model.conformer import Conv2dSubsampling
from .recognizer import Recognizer
from .settings import CHUNK_SIZE, EXPORT_LEFT_CHUNKS

log = logging.getLogger("konkanivani")

__all__ = [
    "ExportError",
    "FORMATS",
    "FILES",
    "STREAMING_FILES",
    "SHERPA_FILES",
    "CHUNK_OUTPUTS",
    "MIN_FRAMES",
    "ONNX_PACKAGES",
    "CTCGraph",
    "ChunkGraph",
    "Streaming",
    "Exported",
    "QUANTIZATIONS",
    "INT8_OPS",
    "INT8_TOLERANCE",
    "unavailable",
    "foreign_files",
    "export_checkpoint",
    "export_onnx",
    "export_torchscript",
    "export_chunk_onnx",
    "onnx_runner",
    "torchscript_runner",
    "chunk_runner",
    "quantize_onnx",
    "max_difference",
    "stream_difference",
    "probability_difference",
    "stream_probability_difference",
    "vocabulary",
    "feature_settings",
    "streaming_settings",
]

FORMATS = ("onnx", "torchscript")
FILES = {
    "onnx": "model.onnx",
    "torchscript": "model.torchscript.pt",
    "vocabulary": "vocabulary.json",
    "features": "features.json",
}
# written with streaming=
STREAMING_FILES = {"onnx": "encoder_chunk.onnx", "settings": "streaming.json"}
# a sherpa-onnx folder's (sherpa_export)
SHERPA_FILES = {"onnx": "model.onnx", "streaming": "model-streaming.onnx", "tokens": "tokens.txt",
                "readme": "README.md"}
# what an export folder may hold: its files, and the temporary folders older versions built in it
EXPORT_NAMES = frozenset([*FILES.values(), *STREAMING_FILES.values(), *SHERPA_FILES.values()])
_OLD_TEMPORARY = ".export-"
# encoder_chunk.onnx's
CHUNK_OUTPUTS = ("log_probs", "encoder_out", "next_attention_cache", "next_conv_cache")
ONNX_PACKAGES = ("onnx", "onnxscript", "onnxruntime")  # the `export` extra
OPSET = 18  # onnxruntime 1.14 and later run it
# the fewest frames the encoder takes: 7
MIN_FRAMES = next(t for t in range(1, 64) if subsampled_lengths(t) >= 1)
# the largest |log-prob difference| from PyTorch an export may show on its check batch
TOLERANCE = 1e-3
QUANTIZATIONS = ("int8",)  # --quantize
# What int8 quantizes: the MatMul nodes with a weight, i.e. every linear layer (feed-forward,
# attention projections, the convolution module's pointwise layers, the subsampling's output and
# the CTC head), 97% of the weights of the small model. The Conv nodes (the subsampling and the
# depthwise convolutions) stay float: onnxruntime's ConvInteger made the small model slower than
# float on one thread, for 2% of its weights (benchmarks/results/int8).
INT8_OPS = ("MatMul",)
# An int8 graph's check against the float graph on the same input: the largest difference of a
# token's probability on a frame (0.02 on checkpoints/streaming_small). Probabilities, not
# log-probabilities: int8 moves the log-probability of a token the model all but rules out (e^-20)
# by more than that of one it weighs, and those do not change a search.
INT8_TOLERANCE = 0.1
# What an int8 file's ONNX metadata (metadata_props) says of it; a float file has none of these.
INT8_METADATA = {
    "quantization": "int8",
    "quantized_ops": ",".join(INT8_OPS),
    "weights": "int8, symmetric, one scale per output channel, 7-bit range (reduce_range)",
    "activations": "uint8, one scale per tensor, computed at run time (dynamic quantization)",
    "float_ops": "Conv (subsampling and depthwise convolutions), attention's activation MatMuls",
}

Runner = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# features, offset, attention_cache, conv_cache[, feature_mean] -> log_probs, encoder_out, the next
# caches
ChunkRunner = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


class ExportError(RuntimeError):
    """An export that failed or does not compute what the model computes; one line saying why."""


class CTCGraph(nn.Module):
    """CMVN, the Conformer encoder and the CTC head of an ``ASRModel`` (eval mode): the graph an
    export holds. The decoder is left out.

    Examples:
        >>> graph = CTCGraph(ASRModel(model_config_from_preset("tiny", vocab_size=40)))
        >>> log_probs, lengths = graph(torch.randn(2, 120, 80), torch.tensor([120, 90]))
        >>> log_probs.shape, lengths.tolist()
        (torch.Size([2, 29, 40]), [29, 21])
    """

    def __init__(self, model: ASRModel):
        super().__init__()
        self.model = model
        self.eval()  # for inference: no dropout, no SpecAugment

    def forward(
        self, features: torch.Tensor, feature_lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """
        Args:
            features: ``(B, T, F)`` raw log-mel features (``LogMel``), zero-padded; feature_lengths
            ``(B,)``.
        Returns:
            ``(B, T', V)`` float32 CTC log-probabilities and their ``(B,)`` lengths.
        """
        enc, lengths = self.model.encode(features, feature_lengths)
        return self.model.ctc_log_probs(enc), lengths


@dataclass(frozen=True)
class Streaming:
    """The chunking a streaming export is made for: ``chunk_size`` encoder frames a chunk (40 ms
    each), attending to itself and ``left_chunks`` chunks before it (the caches' fixed size)."""

    chunk_size: int = CHUNK_SIZE
    left_chunks: int = EXPORT_LEFT_CHUNKS

    def __post_init__(self) -> None:
        for name in ("chunk_size", "left_chunks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")


class ChunkGraph(nn.Module):
    """One chunk of a stream through CMVN, the Conformer encoder and the CTC head of an ``ASRModel``
    with ``causal_conv`` (eval mode), with caches of a fixed size: the graph ``encoder_chunk.onnx``
    holds. It runs the model's own modules as ``ConformerEncoder.forward_chunk`` does, and gives
    what it gives with ``left_frames = left_chunks * chunk_size``; where that keeps a cache of the
    frames so far (fewer at the start), this keeps ``cache_frames`` rows, the newest last, and masks
    those the stream has not filled yet (the first ``cache_frames - offset``).

    With C = ``chunk_size``, L = ``cache_frames``, N blocks, H heads of width d, model width D,
    vocabulary V, K = ``conv_kernel - 1``:

    Args:
        features: ``(1, W, F)`` raw log-mel frames (``LogMel``; the CMVN is in the graph), a window
            of ``feature_windows``: W = ``window_frames`` = (C - 1) * 4 + 7
            (``Conv2dSubsampling.window_frames``); the next starts ``window_hop`` = 4C frames
            later; the stream's last window may be shorter (7 frames or more) and make fewer
            than C frames. offset: int64 scalar, the encoder frames made so far
            (0 for the first chunk, then + C). attention_cache: ``(N, 2, H, L, d)``, each block's
            keys (rotated) and values of the last L frames; zeros at the start (``initial_caches``),
            then the last chunk's ``next_attention_cache``. conv_cache: ``(N, K, D)``, each block's
            last K inputs of its depthwise convolution: zeros, then ``next_conv_cache``.
            feature_mean: ``(F,)``, models with cmvn "utterance" only: what CMVN subtracts, the mean
            of the raw frames of the stream so far (up to the window's end).
    Returns:
        ``log_probs`` ``(1, C, V)`` float32 CTC log-probabilities, ``encoder_out`` ``(1, C, D)``,
        and the caches for the next chunk (``CHUNK_OUTPUTS`` names them in the ONNX file).

    Examples:
        >>> model = ASRModel(model_config_from_preset("tiny", vocab_size=40, causal_conv=True))
        >>> graph = ChunkGraph(model, Streaming(chunk_size=4, left_chunks=2))
        >>> caches = graph.initial_caches()
        >>> [tuple(c.shape) for c in caches.values()]  # 2 blocks, 2 heads of 24, kernel 7
        [(2, 2, 2, 8, 24), (2, 6, 48)]
        >>> window = torch.randn(1, graph.window_frames, 80)
        >>> log_probs, enc, *caches = graph(window, torch.tensor(0), **caches)
        >>> log_probs.shape, enc.shape
        (torch.Size([1, 4, 40]), torch.Size([1, 4, 48]))
    """

    def __init__(self, model: ASRModel, streaming: Streaming):
        super().__init__()
        if not model.cfg.causal_conv:
            raise ValueError("a streaming graph needs a model with causal_conv")
        self.model = model
        self.streaming = streaming
        self.window_frames = Conv2dSubsampling.window_frames(streaming.chunk_size)
        self.window_hop = Conv2dSubsampling.STRIDE * streaming.chunk_size
        self.cache_frames = streaming.left_chunks * streaming.chunk_size
        self.eval()  # for inference: no dropout, no SpecAugment

    @property
    def utterance_cmvn(self) -> bool:
        return self.model.cfg.cmvn == "utterance"

    def initial_caches(self) -> dict[str, torch.Tensor]:
        """The caches of a stream's first chunk: zeros, by input name."""
        cfg = self.model.cfg
        heads, width = cfg.n_heads, cfg.d_model // cfg.n_heads
        return {
            "attention_cache": torch.zeros(cfg.encoder_layers, 2, heads, self.cache_frames, width),
            "conv_cache": torch.zeros(cfg.encoder_layers, cfg.conv_kernel - 1, cfg.d_model),
        }

    def forward(self, features: torch.Tensor, offset: torch.Tensor, attention_cache: torch.Tensor,
                conv_cache: torch.Tensor, feature_mean: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        past = self.cache_frames
        # the cache rows the stream has filled
        filled = torch.arange(past, device=features.device) >= past - offset
        return self.encode(features, offset, filled, attention_cache, conv_cache, feature_mean)

    def encode(self, features: torch.Tensor, offset: torch.Tensor, filled: torch.Tensor,
               attention_cache: torch.Tensor, conv_cache: torch.Tensor,
               feature_mean: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``forward`` with the cache rows the stream has filled given as a bool mask ``(L,)``
        (``forward`` makes it from the offset; sherpa-onnx's streaming graph takes it as an input,
        ``sherpa_export.WenetChunkGraph``)."""
        model, encoder, past = self.model, self.model.encoder, self.cache_frames
        x = model.normalize(features, feature_mean if self.utterance_cmvn else None)
        # the lengths it gives go unused
        x, _ = encoder.subsampling(x, torch.ones(1, dtype=torch.int64))
        frames = x.shape[1]
        rope = encoder.rotary.at(offset, frames)
        # (1, 1, 1, L + C)
        allowed = torch.cat([filled, filled.new_ones(frames)])[None, None, None, :]
        keys_values, conv_inputs = [], []
        for i, block in enumerate(encoder.blocks):  # as ConformerEncoder.forward_chunk, B = 1
            x, (k, v), conv_in = block(x, None, rope, allowed, attention_cache[i, :, None],
                                       conv_cache[i:i + 1])
            # (1, H, L + C, d) each: the cache, then this chunk's; the last L kept
            keys_values.append(torch.cat([k, v])[:, :, k.shape[2] - past:])  # (2, H, L, d)
            conv_inputs.append(conv_in[0])
        return model.ctc_log_probs(x), x, torch.stack(keys_values), torch.stack(conv_inputs)


@dataclass
class Exported:
    path: Path
    # max |log-prob| difference from PyTorch on the check batch (models only); for an int8 model the
    # max token probability difference from the float graph (probability_difference)
    difference: float | None = None
    quantization: str | None = None  # "int8" for a quantized model
    float_bytes: int | None = None  # the size of the float graph it was quantized from


def unavailable(formats: Sequence[str]) -> str | None:
    """Why ``formats`` cannot be exported here (a package missing, a torch too old), or None."""
    if "onnx" not in formats:
        return None
    missing = [name for name in ONNX_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        return (f"ONNX export needs {', '.join(missing)}: pip install 'konkanivani[export]' "
                "(or --format torchscript, which needs nothing more)")
    if not {"dynamo", "dynamic_shapes", "external_data"} <= set(
        inspect.signature(torch.onnx.export).parameters
    ):
        return (f"ONNX export needs torch.onnx.export(dynamo=True, external_data=...), which torch "
                f"{torch.__version__} lacks: upgrade torch (or --format torchscript)")
    return None


def foreign_files(out_dir: str | Path) -> list[str]:
    """The names in the folder ``out_dir`` that no export writes (a user's notes, a checkpoint),
    which replacing the folder with a new export would delete; [] where it does not exist."""
    try:
        names = os.listdir(out_dir)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(n for n in names if n not in EXPORT_NAMES and not n.startswith(_OLD_TEMPORARY))


def _refuse_foreign(out_dir: Path) -> None:
    if foreign := foreign_files(out_dir):
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise ExportError(
            f"{out_dir} holds {foreign[0]}{more}, which no export writes: a new export replaces "
            "the whole folder, so it would be lost; move it away or choose another folder"
        )


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, formats: Sequence[str] = FORMATS,
                      streaming: Streaming | None = None, quantize: str | None = None
                      ) -> list[Exported]:
    """Export ``checkpoint`` into ``out_dir`` (created) as ``formats`` plus vocabulary.json and
    features.json, and with ``streaming`` encoder_chunk.onnx and streaming.json too; with
    ``quantize`` ("int8", ONNX alone) its ONNX files are int8 (see the module). The folder is made
    whole in a temporary folder beside it, checked, then swapped in (``_swap_in``), so it holds
    this export's files and no other's, and a failed or killed export leaves an earlier one whole.
    Raises ``CheckpointError`` for a checkpoint that holds no usable model and ``ExportError`` when
    an export fails or its check does, when ``out_dir`` holds files no export writes
    (``foreign_files``), or a streaming export of a model without ``causal_conv`` is asked for
    (before anything is written)."""
    for fmt in formats:
        if fmt not in FORMATS:
            raise ValueError(f"unknown export format {fmt!r}; choose from {', '.join(FORMATS)}")
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise ValueError(
            f"unknown quantization {quantize!r}; choose from {', '.join(QUANTIZATIONS)}"
        )
    if quantize is not None and tuple(formats) != ("onnx",):
        raise ValueError(f"--quantize {quantize} quantizes the ONNX graphs: it goes with the onnx "
                         "format alone")
    out_dir = Path(os.path.realpath(out_dir))  # a symbolic link keeps pointing at the export
    _refuse_foreign(out_dir)
    recognizer = Recognizer.from_checkpoint(checkpoint)  # CPU, eval mode
    if streaming is not None and not recognizer.model.cfg.causal_conv:
        raise ExportError(
            f"{checkpoint} was trained without --causal_conv: its convolutions look at later"
            " frames, so it cannot stream; train with --causal_conv --dynamic_chunk for a"
            " streaming model"
        )
    graph = CTCGraph(recognizer.model)
    exporters = {
        "onnx": (export_onnx, onnx_runner),
        "torchscript": (export_torchscript, torchscript_runner),
    }
    written = []
    with _building(out_dir) as tmp:
        for fmt in formats:
            export, runner = exporters[fmt]
            path = Path(tmp) / FILES[fmt]
            export(graph, path)
            written.append(Exported(out_dir / FILES[fmt], max_difference(runner(path), graph)))
            if quantize is not None:
                written[-1] = _quantized(
                    written[-1], path,
                    lambda int8, floats: probability_difference(
                        onnx_runner(int8), onnx_runner(floats), graph
                    ),
                )
        if streaming is not None:
            chunk_graph = ChunkGraph(recognizer.model, streaming)
            path = Path(tmp) / STREAMING_FILES["onnx"]
            export_chunk_onnx(chunk_graph, path)
            written.append(
                Exported(out_dir / path.name, stream_difference(chunk_runner(path), chunk_graph))
            )
            if quantize is not None:
                written[-1] = _quantized(
                    written[-1], path,
                    lambda int8, floats: stream_probability_difference(
                        chunk_runner(int8), chunk_runner(floats), chunk_graph
                    ),
                )
            _write_json(
                Path(tmp) / STREAMING_FILES["settings"],
                streaming_settings(chunk_graph, recognizer.frontend),
            )
            written.append(Exported(out_dir / STREAMING_FILES["settings"]))
        _write_json(Path(tmp) / FILES["vocabulary"], vocabulary(recognizer.tokenizer))
        _write_json(Path(tmp) / FILES["features"], feature_settings(recognizer.frontend))
        written += [Exported(out_dir / FILES["vocabulary"]), Exported(out_dir / FILES["features"])]
        _swap_in(tmp, out_dir)
    return written


@contextlib.contextmanager
def _building(out_dir: Path) -> Iterator[Path]:
    """A new folder beside ``out_dir`` (``.NAME.export-PID``, made as ``mkdir`` makes one) to build
    the export in; removed if the block raises (a kill leaves it, hidden, until the next export to
    ``out_dir`` is swapped in: ``_clear_stale_builds``)."""
    tmp = out_dir.with_name(f".{out_dir.name}.export-{os.getpid()}")
    if tmp.exists():  # left by a killed process of the same id
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _swap_in(new: Path, out_dir: Path) -> None:
    """The finished export folder ``new`` put at ``out_dir`` by renames: a folder there (an earlier
    export, checked again to hold nothing else) is first renamed aside, and deleted once the new one
    is in place; if the new one cannot be put there, the old one is renamed back."""
    _refuse_foreign(out_dir)  # files put there while this export ran
    for path in new.iterdir():  # the bytes on disk before the names point at them
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}") if out_dir.exists() else None
    if old is not None:
        if old.exists():
            shutil.rmtree(old)
        os.rename(out_dir, old)
    try:
        os.rename(new, out_dir)
    except OSError:
        if old is not None:
            os.rename(old, out_dir)
        raise
    fsync_dir(out_dir.parent)
    if old is not None:
        shutil.rmtree(old)
    _clear_stale_builds(out_dir)


def _clear_stale_builds(out_dir: Path) -> None:
    """Delete the build folders of ``out_dir`` (``.NAME.export-PID``, ``_building``) left by
    exports that were killed: those whose process is gone. One of a process still running (an
    export under way) and those of other folders' names are left alone; each deleted is a line of
    the log."""
    prefix = f".{out_dir.name}.export-"
    for path in sorted(out_dir.parent.glob(f"{prefix}*")):
        pid = path.name[len(prefix):]
        if not (pid.isascii() and pid.isdigit() and path.is_dir() and not path.is_symlink()
                and _process_gone(int(pid))):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            log.info("removed %s, left by an export whose process (%s) is gone", path, pid)


def _process_gone(pid: int) -> bool:
    """Whether no process ``pid`` runs here (one of another user's still counts as running)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False
    return False


def _quantized(item: Exported, path: Path, check: Callable[[Path, Path], float]) -> Exported:
    """The float ONNX file at ``path`` (``item``, checked) replaced by its int8 graph
    (``quantize_onnx``), once ``check(int8 file, float file)`` has passed."""
    int8 = path.with_name(f"int8-{path.name}")
    quantize_onnx(path, int8)
    difference = check(int8, path)
    float_bytes = path.stat().st_size
    os.replace(int8, path)
    return Exported(item.path, difference, "int8", float_bytes)


def quantize_onnx(source: str | Path, target: str | Path,
                  op_types: Sequence[str] = INT8_OPS) -> None:
    """Write the int8 graph of the float ONNX file ``source`` to ``target``: onnxruntime's dynamic
    quantization (``quantize_dynamic``) of the weights of the ``op_types`` nodes, int8 with one
    scale per output channel in a 7-bit range, their inputs quantized to uint8 as they come; the
    rest of the graph as it was. ``target`` carries ``INT8_METADATA`` (for other ``op_types``, they
    are named) and none of the float exporter's per-node notes. ``ExportError`` in one line if
    onnxruntime cannot quantize it.

    7 bits (reduce_range): CPUs without VNNI (AVX2, AVX-512 before Cascade Lake) multiply uint8 by
    int8 in pairs summed into int16, which 8-bit weights can overflow; onnxruntime's quantization
    guide advises it there, and it cost nothing measurable in CER on this model (its README). No
    pre-processing (``onnxruntime.quantization.preprocess``): its symbolic shape inference stops on
    torch.export's graphs ("Incomplete symbolic shape inference"), and every MatMul with a weight is
    quantized without it (tests/test_export.py counts them)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    try:
        with _quiet_quantizer():
            quantize_dynamic(
                str(source), str(target), weight_type=QuantType.QInt8, per_channel=True,
                reduce_range=True, op_types_to_quantize=list(op_types),
            )
        model = onnx.load(str(target))
        # torch.onnx's notes on the Python line and module that made each node (a fifth of the
        # float file): the quantizer has replaced the nodes they describe.
        for node in model.graph.node:
            del node.metadata_props[:]
        metadata = {**INT8_METADATA, "quantized_ops": ",".join(op_types)}
        if tuple(op_types) != INT8_OPS:  # the benchmark's variants: float_ops is INT8_OPS's
            del metadata["float_ops"]
        onnx.helper.set_model_props(model, metadata)
        onnx.save(model, str(target))
    except Exception as e:
        raise ExportError(
            f"int8 quantization of {Path(source).name} failed "
            f"({type(e).__name__}: {_first_line(e)})"
        ) from e


@contextlib.contextmanager
def _quiet_quantizer() -> Iterator[None]:
    """Silence what onnxruntime's quantizer logs on the root logger (its advice to pre-process, the
    MatMuls it leaves float because neither input is a weight): the module says why."""

    def not_quantizer(record: logging.LogRecord) -> bool:
        return "onnxruntime" not in record.pathname

    root = logging.getLogger()
    root.addFilter(not_quantizer)
    try:
        yield
    finally:
        root.removeFilter(not_quantizer)


def _example_inputs(
    graph: CTCGraph, lengths: Sequence[int], seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Features ``(B, max(lengths), F)`` drawn around the model's CMVN statistics, zero-padded."""
    model = graph.model
    generator = torch.Generator().manual_seed(seed)
    feats = torch.randn(len(lengths), max(lengths), model.cfg.n_mels, generator=generator)
    feats = feats * model.feat_std + model.feat_mean  # (B, T, F)
    lens = torch.tensor(lengths, dtype=torch.int64)
    # padding as collate and Recognizer make it
    feats[torch.arange(max(lengths)) >= lens[:, None]] = 0.0
    return feats, lens


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """Silence the exporters' notes on their own work ("torchvision is not installed", "Removed 53
    unused nodes", ...) and the warnings that are known not to concern this graph."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "onnxscript", "onnx_ir")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            # One symbol for the batch size of both inputs: torch.export notes that it keeps one
            # name.
            warnings.filterwarnings("ignore", message=r".*axis name: .* will not be used")
            # MultiHeadAttention compares the query and memory batch sizes, equal in the encoder's
            # self-attention at every shape: the traced constant holds for all inputs.
            warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
            # torch.jit is deprecated upstream (docs/decoding.md, "Ship the model", says so once).
            warnings.filterwarnings(
                "ignore", message=r"`torch\.jit\.\w+` is deprecated", category=FutureWarning
            )
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def export_onnx(graph: CTCGraph, path: str | Path) -> None:
    """Write ``graph`` to ``path`` as one ONNX file with free batch and frame axes."""
    feats, lens = _example_inputs(graph, [100, 80], seed=0)
    batch, frames = torch.export.Dim("batch"), torch.export.Dim("frames", min=MIN_FRAMES)
    try:
        with _quiet_exporter(), torch.no_grad():
            torch.onnx.export(
                graph,
                (feats, lens),
                str(path),
                dynamo=True,
                opset_version=OPSET,
                verbose=False,
                external_data=False,
                input_names=["features", "feature_lengths"],
                output_names=["log_probs", "log_prob_lengths"],
                dynamic_shapes={"features": {0: batch, 1: frames}, "feature_lengths": {0: batch}},
            )
    except Exception as e:
        raise ExportError(f"ONNX export failed ({type(e).__name__}: {_first_line(e)})") from e


def _chunk_example(
    graph: ChunkGraph, generator: torch.Generator, frames: int
) -> dict[str, torch.Tensor]:
    """Inputs of a chunk in the middle of a stream: ``frames`` feature frames drawn around the CMVN
    statistics, random caches, an offset that fills a part of the attention cache."""
    model = graph.model
    features = (
        torch.randn(1, frames, model.cfg.n_mels, generator=generator) * model.feat_std
        + model.feat_mean
    )
    inputs = {
        "features": features,
        "offset": torch.tensor(max(graph.cache_frames - 1, 0)),
        **{
            name: torch.randn(c.shape, generator=generator)
            for name, c in graph.initial_caches().items()
        },
    }
    if graph.utterance_cmvn:
        inputs["feature_mean"] = model.feat_mean + 0.1 * torch.randn(
            model.cfg.n_mels, generator=generator
        )
    return inputs


def export_chunk_onnx(graph: ChunkGraph, path: str | Path) -> None:
    """Write ``graph`` to ``path`` as one ONNX file: the window's frame axis free (7 frames up to
    ``window_frames``, for a stream's shorter last window), every other axis fixed; the outputs
    named ``CHUNK_OUTPUTS``."""
    inputs = _chunk_example(graph, torch.Generator().manual_seed(0), graph.window_frames)
    names = list(inputs)  # feature_mean only with cmvn "utterance"
    window = (
        None
        if graph.window_frames == MIN_FRAMES
        else torch.export.Dim("window", min=MIN_FRAMES, max=graph.window_frames)
    )
    dynamic = {name: {1: window} if name == "features" and window else None for name in names}
    try:
        with _quiet_exporter(), torch.no_grad():
            torch.onnx.export(
                graph,
                (),
                str(path),
                kwargs=inputs,
                dynamo=True,
                opset_version=OPSET,
                verbose=False,
                external_data=False,
                input_names=names,
                output_names=list(CHUNK_OUTPUTS),
                dynamic_shapes=dynamic,
            )
    except Exception as e:
        raise ExportError(
            f"ONNX export of the chunk graph failed ({type(e).__name__}: {_first_line(e)})"
        ) from e


def export_torchscript(graph: CTCGraph, path: str | Path) -> None:
    """Write ``graph`` to ``path`` as a traced, frozen TorchScript module."""
    feats, lens = _example_inputs(graph, [100, 80], seed=0)
    try:
        with _quiet_exporter(), torch.no_grad():
            traced = torch.jit.trace(graph, (feats, lens), check_trace=False)
            # frozen: the decoder's weights are dropped
            torch.jit.save(torch.jit.freeze(traced), str(path))
    except Exception as e:
        raise ExportError(
            f"TorchScript export failed ({type(e).__name__}: {_first_line(e)})"
        ) from e


def onnx_runner(path: str | Path) -> Runner:
    """The ONNX file at ``path`` on onnxruntime's CPU provider, as a function of torch tensors; its
    ``metadata`` attribute holds the file's ONNX metadata (``INT8_METADATA`` for an int8 one)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def run(
        features: torch.Tensor, feature_lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs, lengths = session.run(None, {"features": features.numpy(),
                                                "feature_lengths": feature_lengths.numpy()})
        return torch.from_numpy(log_probs), torch.from_numpy(lengths)

    run.metadata = dict(session.get_modelmeta().custom_metadata_map)
    return run


def chunk_runner(path: str | Path) -> ChunkRunner:
    """The chunk graph at ``path`` (``export_chunk_onnx``) on onnxruntime's CPU provider, as a
    function of torch tensors taking ``ChunkGraph``'s inputs by name; ``metadata`` as
    ``onnx_runner``'s."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def run(
        **inputs: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        outputs = session.run(None, {name: value.numpy() for name, value in inputs.items()})
        return tuple(torch.from_numpy(o) for o in outputs)

    run.metadata = dict(session.get_modelmeta().custom_metadata_map)
    return run


def torchscript_runner(path: str | Path) -> Runner:
    """The TorchScript file at ``path``, loaded with ``torch.jit.load``."""
    with _quiet_exporter():
        module = torch.jit.load(str(path), map_location="cpu")

    def run(
        features: torch.Tensor, feature_lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return module(features, feature_lengths)

    return run


def max_difference(
    run: Runner, graph: CTCGraph, lengths: Sequence[int] = (137, 61, MIN_FRAMES)
) -> float:
    """The largest |log-prob| difference between ``run`` and ``graph`` over the real frames of a
    batch of ``lengths`` (by default other than the export traced: three utterances, the shortest
    possible among them). ``ExportError`` if the lengths differ or the difference exceeds
    ``TOLERANCE``."""
    feats, lens = _example_inputs(graph, lengths, seed=1)
    with torch.no_grad():
        expected, expected_lens = graph(feats, lens)
        got, got_lens = run(feats, lens)
    if got.shape != expected.shape or not torch.equal(got_lens, expected_lens):
        raise ExportError(
            f"the exported model gives log-probs {tuple(got.shape)} with lengths"
            f" {got_lens.tolist()} where the model gives {tuple(expected.shape)} with"
            f" {expected_lens.tolist()}"
        )
    difference = max(
        float((got[b, :n] - expected[b, :n]).abs().max())
        for b, n in enumerate(expected_lens.tolist())
    )
    if not difference <= TOLERANCE:  # NaN fails too
        raise ExportError(
            f"the exported model's log-probs differ from the model's by up to {difference:.3g} "
            f"(tolerance {TOLERANCE})"
        )
    return difference


def stream_difference(
    run: ChunkRunner, graph: ChunkGraph, chunks: int | None = None, seed: int = 1
) -> float:
    """The largest |difference| of log-probs and encoder frames between ``run`` driven as a stream
    (its own caches fed back, from ``initial_caches``) and ``ConformerEncoder.forward_chunk`` on the
    same windows (``_stream_windows``). ``ExportError`` if a shape differs or the difference exceeds
    ``TOLERANCE``."""
    model = graph.model
    state, caches, difference = None, graph.initial_caches(), 0.0
    for inputs in _stream_windows(graph, chunks, seed):
        window, mean = inputs["features"], inputs.get("feature_mean")
        # the offset the client keeps (the encoder frames so far), not the model's own count
        inputs["offset"] = torch.tensor(0 if state is None else state.offset)
        with torch.no_grad():
            expected, state = model.encoder.forward_chunk(
                model.normalize(window, mean), state, graph.cache_frames
            )
            expected_log_probs = model.ctc_log_probs(expected)
            log_probs, enc, *next_caches = run(**inputs, **caches)
        if log_probs.shape != expected_log_probs.shape or enc.shape != expected.shape:
            raise ExportError(
                f"the exported chunk graph gives log-probs {tuple(log_probs.shape)} for a window of"
                f" {window.shape[1]} frames where the model gives {tuple(expected_log_probs.shape)}"
            )
        difference = max(difference, float((log_probs - expected_log_probs).abs().max()),
                         float((enc - expected).abs().max()))
        caches = dict(zip(caches, next_caches))
    if not difference <= TOLERANCE:  # NaN fails too
        raise ExportError(
            "the exported chunk graph's outputs differ from the model's chunk by chunk by up to "
            f"{difference:.3g} (tolerance {TOLERANCE})"
        )
    return difference


def probability_difference(
    run: Runner, reference: Runner, graph: CTCGraph,
    lengths: Sequence[int] = (137, 61, MIN_FRAMES),
) -> float:
    """The largest difference of a token's probability on a real frame between ``run`` (an int8
    graph) and ``reference`` (the float graph) on the batch ``max_difference`` checks with (drawn
    from ``graph``'s CMVN statistics). ``ExportError`` if the shapes or lengths differ or the
    difference exceeds ``INT8_TOLERANCE``."""
    feats, lens = _example_inputs(graph, lengths, seed=1)
    with torch.no_grad():
        expected, expected_lens = reference(feats, lens)
        got, got_lens = run(feats, lens)
    if got.shape != expected.shape or not torch.equal(got_lens, expected_lens):
        raise ExportError(
            f"the int8 graph gives log-probs {tuple(got.shape)} with lengths {got_lens.tolist()}"
            f" where the float graph gives {tuple(expected.shape)} with {expected_lens.tolist()}"
        )
    return _within_int8_tolerance(max(
        float((got[b, :n].exp() - expected[b, :n].exp()).abs().max())
        for b, n in enumerate(expected_lens.tolist())
    ), "")


def stream_probability_difference(
    run: ChunkRunner, reference: ChunkRunner, graph: ChunkGraph, chunks: int | None = None,
    seed: int = 1,
) -> float:
    """The largest difference of a token's probability on a frame between the chunk graphs ``run``
    (int8) and ``reference`` (float), each driven as a stream with its own caches on the windows of
    ``stream_difference``. ``ExportError`` if a shape differs or the difference exceeds
    ``INT8_TOLERANCE``."""
    caches = {name: graph.initial_caches() for name in ("int8", "float")}
    difference = 0.0
    for k, inputs in enumerate(_stream_windows(graph, chunks, seed)):
        inputs["offset"] = torch.tensor(k * graph.streaming.chunk_size)
        with torch.no_grad():
            got, *next_caches = run(**inputs, **caches["int8"])
            caches["int8"] = dict(zip(caches["int8"], next_caches[1:]))
            expected, *next_caches = reference(**inputs, **caches["float"])
            caches["float"] = dict(zip(caches["float"], next_caches[1:]))
        if got.shape != expected.shape:
            raise ExportError(
                f"the int8 chunk graph gives log-probs {tuple(got.shape)} for a window of"
                f" {inputs['features'].shape[1]} frames where the float one gives"
                f" {tuple(expected.shape)}"
            )
        difference = max(difference, float((got.exp() - expected.exp()).abs().max()))
    return _within_int8_tolerance(difference, " chunk by chunk")


def _within_int8_tolerance(difference: float, how: str) -> float:
    if not difference <= INT8_TOLERANCE:  # NaN fails too
        raise ExportError(
            f"the int8 graph's token probabilities differ from the float graph's{how} by up to "
            f"{difference:.3g} (tolerance {INT8_TOLERANCE})"
        )
    return difference


def _stream_windows(
    graph: ChunkGraph, chunks: int | None, seed: int
) -> Iterator[dict[str, torch.Tensor]]:
    """The inputs but the offset and the caches of each window of a check stream: ``chunks`` full
    chunks (default ``left_chunks + 2``: the first ones with the attention cache not yet full,
    then full), then a shorter last one (of half a chunk, or a whole one for chunks of 1), of
    frames drawn from the CMVN statistics; with cmvn "utterance" the running mean of the stream's
    raw frames, as a client keeps it."""
    chunk = graph.streaming.chunk_size
    chunks = graph.streaming.left_chunks + 2 if chunks is None else chunks
    frames = chunks * graph.window_hop + Conv2dSubsampling.window_frames(max(chunk // 2, 1))
    features = _chunk_example(graph, torch.Generator().manual_seed(seed), frames)["features"]
    for start in range(0, frames - MIN_FRAMES + 1, graph.window_hop):
        window = features[:, start:start + graph.window_frames]
        inputs = {"features": window}
        if graph.utterance_cmvn:
            inputs["feature_mean"] = features[0, :start + window.shape[1]].mean(0)
        yield inputs


def vocabulary(tokenizer: Tokenizer) -> dict[str, Any]:
    """What greedy CTC decoding needs of the tokenizer, as JSON: the pieces by id and the special
    ids."""
    return {
        "blank_id": BLANK_ID,
        "unk_id": UNK_ID,  # never a CTC target: a trained model does not emit it
        # the attention decoder's start/end symbol; never a CTC target either
        "sos_eos_id": SOS_EOS_ID,
        "word_boundary": "\u2581",
        "decoding": (
            "greedy CTC: the best id of each of the first log_prob_lengths frames, repeats merged, "
            "blank_id and sos_eos_id dropped; text: the pieces joined, leading word_boundary "
            "characters stripped and the others turned into spaces"
        ),
        "pieces": tokenizer.pieces(range(tokenizer.vocab_size)),  # id -> piece
    }


def feature_settings(frontend: LogMel | KaldiFbank) -> dict[str, Any]:
    """How ``frontend`` turns audio into features, as JSON. ``mel_spectrogram`` holds the arguments
    of ``torchaudio.transforms.MelSpectrogram`` that make the same filterbank (its window is
    ``torch.hann_window``, periodic); for ``KaldiFbank``, ``kaldi_fbank`` those of
    ``torchaudio.compliance.kaldi.fbank`` (kaldi-native-fbank's, named as Kaldi names them)."""
    if isinstance(frontend, KaldiFbank):
        return {
            "sample_rate": SAMPLE_RATE,
            "frontend": frontend.name,
            "n_mels": frontend.n_mels,
            "kaldi_fbank": {**KALDI_FBANK, "num_mel_bins": frontend.n_mels},
            "sample_scale": INT16_SCALE,
            "floor": KALDI_FLOOR,
            "features": (
                "max(kaldi_fbank(waveform * sample_scale), floor), (T, n_mels);"
                " T = (samples + 80) // 160; not normalized: the model holds the CMVN"
            ),
            "min_frames": MIN_FRAMES,
            "output_lengths": "T' = ((T - 1) // 2 - 1) // 2",
            "output_frame_seconds": 4 * HOP_LENGTH / SAMPLE_RATE,
        }
    mel = frontend.mel
    stft, filterbank = mel.spectrogram, mel.mel_scale
    sample_rate = filterbank.sample_rate
    return {
        "sample_rate": sample_rate,
        "channels": (
            "mono: the mean of the file's channels, resampled to sample_rate "
            "(torchaudio.functional.resample) if it has another"
        ),
        "n_mels": filterbank.n_mels,
        "window": "hann (periodic)",
        "mel_spectrogram": {
            "sample_rate": sample_rate,
            "n_fft": stft.n_fft,
            "win_length": stft.win_length,
            "hop_length": stft.hop_length,
            "f_min": filterbank.f_min,
            "f_max": filterbank.f_max,
            "pad": stft.pad,
            "n_mels": filterbank.n_mels,
            "power": stft.power,
            "normalized": stft.normalized,
            "center": stft.center,
            "pad_mode": stft.pad_mode,
            "norm": filterbank.norm,
            "mel_scale": filterbank.mel_scale,
        },
        "log_offset": LOG_OFFSET,
        "features": (
            "ln(mel_spectrogram(waveform) + log_offset), transposed to (T, n_mels); "
            "T = 1 + samples // hop_length; not normalized: the model holds the CMVN"
        ),
        "min_frames": MIN_FRAMES,
        "output_lengths": "T' = ((T - 1) // 2 - 1) // 2",
        "output_frame_seconds": 4 * stft.hop_length / sample_rate,
    }


def streaming_settings(graph: ChunkGraph, frontend: LogMel | KaldiFbank) -> dict[str, Any]:
    """How a client streams through ``encoder_chunk.onnx`` (``ChunkGraph``) with features of
    ``frontend``, as JSON."""
    caches = graph.initial_caches()
    return {
        "chunk_size": graph.streaming.chunk_size,
        "left_chunks": graph.streaming.left_chunks,
        "chunk_seconds": (
            graph.streaming.chunk_size * feature_settings(frontend)["output_frame_seconds"]
        ),
        "window_frames": graph.window_frames,
        "window_hop": graph.window_hop,
        "min_window_frames": MIN_FRAMES,
        "windows": (
            "feature frames start .. start + window_frames - 1 for start = 0, window_hop, 2 *"
            " window_hop, ... while start + min_window_frames <= T: the last window may be shorter"
            " and give fewer frames"
        ),
        "cmvn": graph.model.cfg.cmvn,
        "inputs": {
            "features": (
                "(1, W, n_mels) float32 raw log-mel frames of a window (as features.json says; the"
                f" CMVN is in the graph), W = window_frames, or {MIN_FRAMES} .. window_frames for"
                " the last"
            ),
            "offset": "() int64: the encoder frames of the windows before (0, then + chunk_size)",
            "attention_cache": (
                f"{list(caches['attention_cache'].shape)} float32 (blocks, keys and values, heads, "
                "left_chunks * chunk_size frames, head width): zeros, then next_attention_cache"
            ),
            "conv_cache": (
                f"{list(caches['conv_cache'].shape)} float32 (blocks, conv_kernel - 1, d_model):"
                " zeros, then next_conv_cache"
            ),
            **(
                {
                    "feature_mean": (
                        "(n_mels,) float32: the mean of the raw log-mel frames from the stream's"
                        " start to this window's end"
                    )
                }
                if graph.utterance_cmvn
                else {}
            ),
        },
        "cache_shapes": {name: list(c.shape) for name, c in caches.items()},
        "outputs": {
            "log_probs": (
                "(1, C, V) float32 CTC log-probabilities of the window's C encoder frames (C ="
                " chunk_size but in a shorter last window)"
            ),
            "encoder_out": "(1, C, d_model) float32 encoder frames (for attention rescoring)",
            "next_attention_cache": "the attention_cache input of the next window",
            "next_conv_cache": "the conv_cache input of the next window",
        },
    }


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]
