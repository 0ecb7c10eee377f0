"""A ``konkanivani-export`` folder as a recognizer, on onnxruntime: what ``konkanivani-serve DIR``
loads.

The folder holds the encoder and CTC head (``model.onnx``), the pieces of the vocabulary
(``vocabulary.json``), how the features are made (``features.json``) and, from ``--streaming``, the
chunk graph (``encoder_chunk.onnx``, ``streaming.json``); see ``decoding.model_export``. The
attention decoder is not exported, so an export decodes with CTC alone: ``greedy`` (the best path)
or ``beam`` (CTC prefix beam search, ``search.ctc_prefix_beam_search``) over the graph's
log-probabilities, with no attention rescoring and no language model.

``ExportedRecognizer.decode_waveforms`` decodes whole waveforms through ``model.onnx``;
``ExportedRecognizer.stream`` gives a ``streaming.Stream`` whose chunks go through
``encoder_chunk.onnx`` (``GraphChunks``) in the chunk size and left context the export was made for.
The features are this package's (``LogMel`` or ``KaldiFbank``, as ``features.json`` says; other
settings are refused). An int8 export (``--quantize int8``) holds int8 graphs under the same
names and loads the same way; ``ExportedRecognizer.quantization`` says which it is, from the
graphs' ONNX metadata.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..data.features import make_frontend
from ..data.frames import SAMPLE_RATE
from .model_export import (
    FILES,
    STREAMING_FILES,
    ChunkRunner,
    ExportError,
    chunk_runner,
    feature_settings,
    onnx_runner,
)
from .search import ctc_greedy, ctc_prefix_beam_search
from .settings import EXPORTED_METHODS, DecodingConfig
from .streaming import Result, Stream, aligned_results, check_sample_rate

__all__ = ["EXPORTED_METHODS", "ExportedRecognizer", "GraphChunks", "Pieces"]


class Pieces:
    """Token ids to text as ``vocabulary.json`` says (the export holds no SentencePiece model): the
    pieces joined, blank and sos/eos dropped, the word boundary marks turned into spaces. What
    ``Tokenizer.decode`` and ``Tokenizer.pieces`` give, but for <unk> (SentencePiece spells it " ⁇
    "),
    which a trained model does not emit."""

    def __init__(self, vocabulary: dict[str, Any]):
        self.by_id: list[str] = list(vocabulary["pieces"])
        self.dropped = {int(vocabulary["blank_id"]), int(vocabulary["sos_eos_id"])}
        self.boundary: str = vocabulary["word_boundary"]
        self.vocab_size = len(self.by_id)

    def decode(self, ids: Sequence[int]) -> str:
        text = "".join(self.by_id[int(i)] for i in ids if int(i) not in self.dropped)
        return text.lstrip(self.boundary).replace(self.boundary, " ")

    def pieces(self, ids: Sequence[int]) -> list[str]:
        return [self.by_id[int(i)] for i in ids]


class GraphChunks:
    """How a ``Stream`` encodes through ``encoder_chunk.onnx``: raw log-mel frames kept as they come
    (the graph holds the CMVN; with cmvn "utterance" each frame carries the running mean of the
    frames up to it, and a window is normalized by the mean up to its end, as ``streaming.json``
    asks), a window through the graph with the caches it gave last and the offset, the caches fed
    back. Its
    caches have the fixed size of the export's ``left_chunks``."""

    def __init__(self, run: ChunkRunner, settings: dict[str, Any], n_mels: int):
        self.run, self.n_mels = run, n_mels
        self.utterance = settings["cmvn"] == "utterance"
        self.initial = {
            name: torch.zeros(shape) for name, shape in settings["cache_shapes"].items()
        }
        self.feat_sum = torch.zeros(n_mels, dtype=torch.float64)
        self.feat_count = 0
        self.reset()

    def reset(self) -> None:
        """A new segment: the caches start again, at offset 0."""
        self.caches, self.offset = dict(self.initial), 0

    def prepare(self, feats: torch.Tensor) -> torch.Tensor:
        """New raw frames ``(T, F)``; with cmvn "utterance", each followed by the mean of the frames
        up to it ``(T, 2F)``."""
        feats = feats.float().cpu()
        if not self.utterance:
            return feats
        sums = self.feat_sum + feats.double().cumsum(0)
        counts = self.feat_count + torch.arange(1, len(feats) + 1, dtype=torch.float64)
        if len(feats):
            self.feat_sum, self.feat_count = sums[-1], self.feat_count + len(feats)
        return torch.cat([feats, (sums / counts[:, None]).float()], dim=1)

    def encode(self, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A window of prepared frames: the chunk's CTC log-probabilities ``(C, V)`` and encoder
        frames ``(C, D)``."""
        inputs = {
            "features": window[None, :, : self.n_mels].contiguous(),
            "offset": torch.tensor(self.offset),
            **self.caches,
        }
        if self.utterance:
            inputs["feature_mean"] = window[-1, self.n_mels:].contiguous()
        log_probs, enc, attention_cache, conv_cache = self.run(**inputs)
        self.caches = {"attention_cache": attention_cache, "conv_cache": conv_cache}
        self.offset += log_probs.shape[1]
        return log_probs[0], enc[0]


class ExportedRecognizer:
    """The recognizer of an export folder (see the module); ``ExportError`` in one line for a folder
    that is not a whole export. ``streaming`` holds ``streaming.json`` when the folder has the chunk
    graph, else None. ``quantization`` is "int8" for an int8 export, None for a float one; a folder
    whose two graphs differ in it (two exports into one folder) is refused.

    Its decoding methods take a ``DecodingConfig`` and keyword overrides of its fields, as
    ``Recognizer``'s do (``settings``).

    Examples:
        >>> rec = ExportedRecognizer("checkpoints/run/model_export")  # doctest: +SKIP
        >>> rec.decode_waveforms([load_audio("clip.wav")], method="greedy")  # doctest: +SKIP
    """

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        self.folder = folder
        missing = [name for name in (FILES["onnx"], FILES["vocabulary"], FILES["features"])
                   if not (folder / name).is_file()]
        if missing:
            raise ExportError(
                f"{folder}: not a konkanivani-export folder (no {', '.join(missing)})"
            )
        vocabulary, features = _read_json(folder / FILES["vocabulary"]), _read_json(
            folder / FILES["features"]
        )
        try:
            self.tokenizer = Pieces(vocabulary)
            # feature_settings names a Kaldi fbank export's frontend; a log-mel export names none
            self.frontend = make_frontend(features.get("frontend", "log_mel"),
                                         int(features["n_mels"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ExportError(
                f"{folder}: {FILES['vocabulary']} or {FILES['features']} is not an export's "
                f"({type(e).__name__}: {e})"
            ) from e
        if json.loads(json.dumps(feature_settings(self.frontend))) != features:
            raise ExportError(
                f"{folder}: {FILES['features']} describes other features than this konkanivani "
                "computes (made by another version?)"
            )
        self.run = _session(onnx_runner, folder / FILES["onnx"])
        chunk_graph, settings = (
            folder / STREAMING_FILES["onnx"],
            folder / STREAMING_FILES["settings"],
        )
        self.streaming: dict[str, Any] | None = None
        if chunk_graph.is_file() and settings.is_file():
            self.streaming = _read_json(settings)
            if not {"chunk_size", "left_chunks", "cmvn", "cache_shapes"} <= set(self.streaming):
                raise ExportError(f"{settings}: not an export's streaming settings")
            self.chunk_run = _session(chunk_runner, chunk_graph)
        self.quantization: str | None = self.run.metadata.get("quantization")
        if self.streaming is not None:
            chunk_quantization = self.chunk_run.metadata.get("quantization")
            if chunk_quantization != self.quantization:
                raise ExportError(
                    f"{folder}: {FILES['onnx']} is {self.quantization or 'float'} but "
                    f"{STREAMING_FILES['onnx']} is {chunk_quantization or 'float'} (two exports in"
                    " one folder?): export the checkpoint again into an empty folder"
                )

    def settings(self, decoding: DecodingConfig | None = None, *, streams: bool = False,
                 **overrides) -> DecodingConfig:
        """The settings a call decodes with: ``decoding`` with ``overrides``, checked
        (``ConfigError``, a ``ValueError``, in one line: CTC alone) and resolved
        (``DecodingConfig.resolved``). A stream is in the export's own chunks: ``ValueError`` for
        others."""
        d = DecodingConfig.of(decoding, **overrides)
        if streams and self.streaming is not None:
            own = self.streaming["chunk_size"], self.streaming["left_chunks"]
            if d.chunk_size not in (0, own[0]) or d.left_chunks not in (-1, own[1]):
                raise ValueError(f"the export streams in chunks of {own[0]} frames seeing {own[1]} "
                                 "back (its streaming.json): --chunk_size and --left_chunks cannot "
                                 "change that")
            d = dataclasses.replace(d, chunk_size=own[0], left_chunks=own[1])
        return d.resolved(streams, exported=True)

    def decode_waveforms(self, wavs: Sequence[torch.Tensor], decoding: DecodingConfig | None = None,
                         **overrides) -> list[str]:
        """Texts of 16 kHz mono waveforms, as one batch through ``model.onnx``: ``greedy`` or
        ``beam``."""
        return [r.text for r in self.decode_results(wavs, decoding, **overrides)]

    @torch.inference_mode()
    def decode_results(self, wavs: Sequence[torch.Tensor], decoding: DecodingConfig | None = None,
                       offset: float = 0.0, **overrides) -> list[Result]:
        """``decode_waveforms`` with the words, as ``Recognizer.decode_results`` gives them: a
        final ``Result`` per waveform, its words aligned to the graph's CTC log-probabilities
        (``alignment.align_words``) and timed from ``offset`` seconds."""
        d = self.settings(decoding, **overrides)
        feats = [self.frontend(w) for w in wavs]
        lens = torch.tensor([len(f) for f in feats], dtype=torch.int64)
        log_probs, log_prob_lens = self.run(
            torch.nn.utils.rnn.pad_sequence(feats, batch_first=True), lens
        )
        if d.method == "greedy":
            ids = ctc_greedy(log_probs, log_prob_lens)
        else:
            ids = [ctc_prefix_beam_search(log_probs[b], int(n), d.beam_size)[0].tokens
                   for b, n in enumerate(log_prob_lens.tolist())]
        return aligned_results(self.tokenizer, ids, wavs, log_probs, log_prob_lens, offset)

    def stream(self, decoding: DecodingConfig | None = None, *, sample_rate: int = SAMPLE_RATE,
               **overrides) -> Stream:
        """A ``Stream`` through ``encoder_chunk.onnx`` in the export's chunks, decoded with
        ``greedy`` or ``beam``; ``ValueError`` in one line for a folder without the chunk graph or
        settings it cannot take."""
        if self.streaming is None:
            raise ValueError(
                f"{self.folder} holds no {STREAMING_FILES['onnx']}: export the checkpoint with "
                "--streaming (a model trained with --causal_conv) to stream"
            )
        d = self.settings(decoding, streams=True, **overrides)
        check_sample_rate(sample_rate)
        chunks = GraphChunks(self.chunk_run, self.streaming, self.frontend.n_mels)
        return Stream(None, self.tokenizer, self.frontend, d, None, sample_rate, chunks=chunks)


def _session(runner: Callable[[Path], Any], path: Path) -> Any:
    """``runner(path)``: an onnxruntime session of the file; ``ExportError`` in one line when it
    cannot load it (onnxruntime raises its own exceptions, none a ``RuntimeError``)."""
    try:
        return runner(path)
    except Exception as e:  # noqa: BLE001  InvalidProtobuf, Fail, NoSuchFile ...
        raise ExportError(f"{path}: onnxruntime cannot load it ({type(e).__name__}: "
                          f"{(str(e).strip().splitlines() or [''])[0]})") from e


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ExportError(f"{path}: unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(value, dict):
        raise ExportError(f"{path}: not an export's settings (a JSON object)")
    return value
