"""A checkpoint's encoder and CTC head as ONNX and TorchScript files, for decoding without konkanivani.

An export folder holds::

    model.onnx              ONNX (opset 18), for onnxruntime and other ONNX runtimes
    model.torchscript.pt    TorchScript, for torch.jit.load (C++ libtorch included)
    vocabulary.json         token id -> SentencePiece piece, the blank id, how to join pieces into text
    features.json           how the log-mel features are made (sample rate, window, hop, mel bins, log)

Both graphs take ``features`` ``(B, T, F)`` float32, log-mel frames exactly as ``audio.LogMel`` makes
them (CMVN lives in the model, global or per utterance, so it is inside the graph), and ``feature_lengths`` ``(B,)``
int64; they return ``log_probs`` ``(B, T', V)`` float32 CTC log-probabilities and
``log_prob_lengths`` ``(B,)`` int64. B and T are free (T >= ``MIN_FRAMES``).

ONNX goes through ``torch.export`` (``torch.onnx.export(dynamo=True)``, which needs onnxscript):
it traces with symbolic batch and frame counts and fails at export where a shape would be baked in.
The older TorchScript-based ONNX exporter records Python-level branches on shapes as constants (it
warns and carries on) and is deprecated. TorchScript is ``torch.jit.trace`` of the same module,
frozen so the file holds only the weights the graph uses. Every file is run after it is written on
a batch of other lengths than it was traced with, and compared with the PyTorch model.
"""
from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import logging
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..data.audio import LOG_OFFSET, LogMel
from ..data.frames import subsampled_lengths
from ..data.tokenizer import BLANK_ID, SOS_EOS_ID, UNK_ID, Tokenizer
from ..model.asr import ASRModel
from .recognizer import Recognizer

__all__ = ["ExportError", "FORMATS", "FILES", "MIN_FRAMES", "ONNX_PACKAGES", "CTCGraph", "Exported",
           "unavailable", "export_checkpoint", "export_onnx", "export_torchscript", "onnx_runner",
           "torchscript_runner", "max_difference", "vocabulary", "feature_settings"]

FORMATS = ("onnx", "torchscript")
FILES = {"onnx": "model.onnx", "torchscript": "model.torchscript.pt", "vocabulary": "vocabulary.json",
         "features": "features.json"}
ONNX_PACKAGES = ("onnx", "onnxscript", "onnxruntime")  # the `export` extra
OPSET = 18  # onnxruntime 1.14 and later run it
MIN_FRAMES = next(t for t in range(1, 64) if subsampled_lengths(t) >= 1)  # the fewest frames the encoder takes: 7
TOLERANCE = 1e-3  # the largest |log-prob difference| from PyTorch an export may show on its check batch

Runner = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


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

    def forward(self, features: torch.Tensor, feature_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """
        Args:
            features: ``(B, T, F)`` raw log-mel features (``LogMel``), zero-padded; feature_lengths ``(B,)``.
        Returns:
            ``(B, T', V)`` float32 CTC log-probabilities and their ``(B,)`` lengths.
        """
        enc, lengths = self.model.encode(features, feature_lengths)
        return self.model.ctc_log_probs(enc), lengths


@dataclass
class Exported:
    path: Path
    difference: float | None = None  # max |log-prob| difference from PyTorch on the check batch (models only)


def unavailable(formats: Sequence[str]) -> str | None:
    """Why ``formats`` cannot be exported here (a package missing, a torch too old), or None."""
    if "onnx" not in formats:
        return None
    missing = [name for name in ONNX_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        return (f"ONNX export needs {', '.join(missing)}: pip install 'konkanivani[export]' "
                "(or --format torchscript, which needs nothing more)")
    if not {"dynamo", "dynamic_shapes", "external_data"} <= set(inspect.signature(torch.onnx.export).parameters):
        return (f"ONNX export needs torch.onnx.export(dynamo=True, external_data=...), which torch "
                f"{torch.__version__} lacks: upgrade torch (or --format torchscript)")
    return None


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, formats: Sequence[str] = FORMATS) -> list[Exported]:
    """Export ``checkpoint`` into ``out_dir`` (created) as ``formats`` plus vocabulary.json and
    features.json. Files are written to a temporary folder, checked, then moved into place, so a
    failed export leaves an earlier one whole. Raises ``CheckpointError`` for a checkpoint that
    holds no usable model and ``ExportError`` when an export fails or its check does."""
    for fmt in formats:
        if fmt not in FORMATS:
            raise ValueError(f"unknown export format {fmt!r}; choose from {', '.join(FORMATS)}")
    recognizer = Recognizer.from_checkpoint(checkpoint)  # CPU, eval mode
    graph = CTCGraph(recognizer.model)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    exporters = {"onnx": (export_onnx, onnx_runner), "torchscript": (export_torchscript, torchscript_runner)}
    written = []
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".export-") as tmp:
        for fmt in formats:
            export, runner = exporters[fmt]
            path = Path(tmp) / FILES[fmt]
            export(graph, path)
            written.append(Exported(out_dir / FILES[fmt], max_difference(runner(path), graph)))
        _write_json(Path(tmp) / FILES["vocabulary"], vocabulary(recognizer.tokenizer))
        _write_json(Path(tmp) / FILES["features"], feature_settings(recognizer.log_mel))
        written += [Exported(out_dir / FILES["vocabulary"]), Exported(out_dir / FILES["features"])]
        for item in written:
            shutil.move(Path(tmp) / item.path.name, item.path)  # a rename within the folder
    return written


def _example_inputs(graph: CTCGraph, lengths: Sequence[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Features ``(B, max(lengths), F)`` drawn around the model's CMVN statistics, zero-padded."""
    model = graph.model
    generator = torch.Generator().manual_seed(seed)
    feats = torch.randn(len(lengths), max(lengths), model.cfg.n_mels, generator=generator)
    feats = feats * model.feat_std + model.feat_mean  # (B, T, F)
    lens = torch.tensor(lengths, dtype=torch.int64)
    feats[torch.arange(max(lengths)) >= lens[:, None]] = 0.0  # padding as collate and Recognizer make it
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
            # One symbol for the batch size of both inputs: torch.export notes that it keeps one name.
            warnings.filterwarnings("ignore", message=r".*axis name: .* will not be used")
            # MultiHeadAttention compares the query and memory batch sizes, equal in the encoder's
            # self-attention at every shape: the traced constant holds for all inputs.
            warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
            # torch.jit is deprecated upstream (docs/decoding.md, "Ship the model", says so once).
            warnings.filterwarnings("ignore", message=r"`torch\.jit\.\w+` is deprecated", category=FutureWarning)
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
            torch.onnx.export(graph, (feats, lens), str(path), dynamo=True, opset_version=OPSET, verbose=False,
                              external_data=False, input_names=["features", "feature_lengths"],
                              output_names=["log_probs", "log_prob_lengths"],
                              dynamic_shapes={"features": {0: batch, 1: frames}, "feature_lengths": {0: batch}})
    except Exception as e:
        raise ExportError(f"ONNX export failed ({type(e).__name__}: {_first_line(e)})") from e


def export_torchscript(graph: CTCGraph, path: str | Path) -> None:
    """Write ``graph`` to ``path`` as a traced, frozen TorchScript module."""
    feats, lens = _example_inputs(graph, [100, 80], seed=0)
    try:
        with _quiet_exporter(), torch.no_grad():
            traced = torch.jit.trace(graph, (feats, lens), check_trace=False)
            torch.jit.save(torch.jit.freeze(traced), str(path))  # frozen: the decoder's weights are dropped
    except Exception as e:
        raise ExportError(f"TorchScript export failed ({type(e).__name__}: {_first_line(e)})") from e


def onnx_runner(path: str | Path) -> Runner:
    """The ONNX file at ``path`` on onnxruntime's CPU provider, as a function of torch tensors."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def run(features: torch.Tensor, feature_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs, lengths = session.run(None, {"features": features.numpy(),
                                                "feature_lengths": feature_lengths.numpy()})
        return torch.from_numpy(log_probs), torch.from_numpy(lengths)

    return run


def torchscript_runner(path: str | Path) -> Runner:
    """The TorchScript file at ``path``, loaded with ``torch.jit.load``."""
    with _quiet_exporter():
        module = torch.jit.load(str(path), map_location="cpu")

    def run(features: torch.Tensor, feature_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return module(features, feature_lengths)

    return run


def max_difference(run: Runner, graph: CTCGraph, lengths: Sequence[int] = (137, 61, MIN_FRAMES)) -> float:
    """The largest |log-prob| difference between ``run`` and ``graph`` over the real frames of a
    batch of ``lengths`` (by default other than the export traced: three utterances, the shortest
    possible among them). ``ExportError`` if the lengths differ or the difference exceeds ``TOLERANCE``."""
    feats, lens = _example_inputs(graph, lengths, seed=1)
    with torch.no_grad():
        expected, expected_lens = graph(feats, lens)
        got, got_lens = run(feats, lens)
    if got.shape != expected.shape or not torch.equal(got_lens, expected_lens):
        raise ExportError(f"the exported model gives log-probs {tuple(got.shape)} with lengths {got_lens.tolist()} "
                          f"where the model gives {tuple(expected.shape)} with {expected_lens.tolist()}")
    difference = max(float((got[b, :n] - expected[b, :n]).abs().max()) for b, n in enumerate(expected_lens.tolist()))
    if not difference <= TOLERANCE:  # NaN fails too
        raise ExportError(f"the exported model's log-probs differ from the model's by up to {difference:.3g} "
                          f"(tolerance {TOLERANCE})")
    return difference


def vocabulary(tokenizer: Tokenizer) -> dict[str, Any]:
    """What greedy CTC decoding needs of the tokenizer, as JSON: the pieces by id and the special ids."""
    return {
        "blank_id": BLANK_ID,
        "unk_id": UNK_ID,  # never a CTC target: a trained model does not emit it
        "sos_eos_id": SOS_EOS_ID,  # the attention decoder's start/end symbol; never a CTC target either
        "word_boundary": "\u2581",
        "decoding": "greedy CTC: the best id of each of the first log_prob_lengths frames, repeats merged, "
                    "blank_id and sos_eos_id dropped; text: the pieces joined, leading word_boundary "
                    "characters stripped and the others turned into spaces",
        "pieces": tokenizer.pieces(range(tokenizer.vocab_size)),  # id -> piece
    }


def feature_settings(log_mel: LogMel) -> dict[str, Any]:
    """How ``log_mel`` turns audio into features, as JSON. ``mel_spectrogram`` holds the arguments
    of ``torchaudio.transforms.MelSpectrogram`` that make the same filterbank (its window is
    ``torch.hann_window``, periodic)."""
    mel = log_mel.mel
    stft, filterbank = mel.spectrogram, mel.mel_scale
    sample_rate = filterbank.sample_rate
    return {
        "sample_rate": sample_rate,
        "channels": "mono: the mean of the file's channels, resampled to sample_rate "
                    "(torchaudio.functional.resample) if it has another",
        "n_mels": filterbank.n_mels,
        "window": "hann (periodic)",
        "mel_spectrogram": {
            "sample_rate": sample_rate, "n_fft": stft.n_fft, "win_length": stft.win_length,
            "hop_length": stft.hop_length, "f_min": filterbank.f_min, "f_max": filterbank.f_max,
            "pad": stft.pad, "n_mels": filterbank.n_mels, "power": stft.power, "normalized": stft.normalized,
            "center": stft.center, "pad_mode": stft.pad_mode, "norm": filterbank.norm,
            "mel_scale": filterbank.mel_scale,
        },
        "log_offset": LOG_OFFSET,
        "features": "ln(mel_spectrogram(waveform) + log_offset), transposed to (T, n_mels); "
                    "T = 1 + samples // hop_length; not normalized: the model holds the CMVN",
        "min_frames": MIN_FRAMES,
        "output_lengths": "T' = ((T - 1) // 2 - 1) // 2",
        "output_frame_seconds": 4 * stft.hop_length / sample_rate,
    }


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]
