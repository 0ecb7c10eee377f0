"""The recognizer a server holds, loaded once and only read, and how the server decodes with it.

Decoding is CPU-bound, so none of it runs on the event loop: ``Engine.run`` hands a call to a pool of
``workers`` decode threads (one by default: PyTorch's own threads already use every core), and the
loop stays free to answer ``/health`` and to read the next frames while a chunk decodes.

A streaming checkpoint (trained with ``--causal_conv``) decodes an upload as ``konkanivani-transcribe
--chunk_size`` does a file: through a stream, in segments that end at pauses, with word times. Any
other checkpoint decodes it as that tool does a long file: in windows of at most 20 s cut at quiet
moments (``quiet_windows``), each decoded whole with ``method``; it cannot stream (``/stream`` says so).

An export folder (``decoding.exported.ExportedRecognizer``, onnxruntime) decodes uploads in those
windows through ``model.onnx`` with ``greedy`` or ``beam`` (no attention decoder: nothing rescored),
and streams through ``encoder_chunk.onnx`` when it has it, in the chunks it was exported for.
"""
from __future__ import annotations

import asyncio
import io
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, TypeVar

import soundfile as sf
import torch

from ..data.audio import AudioError, load_audio
from ..data.frames import SAMPLE_RATE
from ..decoding.exported import EXPORTED_METHODS, ExportedRecognizer
from ..decoding.recognizer import MIN_SAMPLES, Recognizer
from ..decoding.search import DEFAULT_CTC_WEIGHT, METHODS
from ..decoding.streaming import DEFAULT_ENDPOINT_MS, Result, Stream, check_sample_rate, quiet_windows

__all__ = ["Decoding", "Engine", "UploadTooLong"]

T = TypeVar("T")
UPLOAD = "the upload"  # how messages name an uploaded file: never by a name the client chose


class UploadTooLong(ValueError):
    """An upload holds more audio than the server takes (``Limits.max_upload_seconds``)."""


@dataclass(frozen=True)
class Decoding:
    """How the server decodes: ``method`` (for a streaming model one of ``STREAM_METHODS``), and for a
    streaming model its chunks, left context and endpoint."""

    method: str
    beam_size: int = 10
    ctc_weight: float = DEFAULT_CTC_WEIGHT
    chunk_size: int = 16  # encoder frames (40 ms each) per chunk: a partial result every 640 ms
    left_chunks: int = -1
    endpoint_ms: float = DEFAULT_ENDPOINT_MS


class Engine:
    """A recognizer (a checkpoint's, or an export folder's) and its decoding settings, checked once
    (``ValueError`` in one line), and the decode threads. ``streaming`` says whether the model can
    stream."""

    def __init__(self, recognizer: Recognizer | ExportedRecognizer, decoding: Decoding, workers: int = 1):
        self.recognizer, self.decoding = recognizer, decoding
        self.exported = isinstance(recognizer, ExportedRecognizer)
        if self.exported:
            self.streaming = recognizer.streaming is not None
            if decoding.method not in EXPORTED_METHODS:
                raise ValueError(f"an ONNX export decodes with {' or '.join(EXPORTED_METHODS)} (CTC): the attention "
                                 f"decoder that {decoding.method} needs is not exported")
            if self.streaming:
                exported = recognizer.streaming["chunk_size"], recognizer.streaming["left_chunks"]
                if (decoding.chunk_size, decoding.left_chunks) != exported:
                    raise ValueError(f"the export streams in chunks of {exported[0]} frames seeing {exported[1]} back "
                                     "(its streaming.json): --chunk_size and --left_chunks cannot change that")
        else:
            self.streaming = bool(recognizer.model.cfg.causal_conv)
            for p in recognizer.model.parameters():  # read-only: no request can train or change it
                p.requires_grad_(False)
            if not self.streaming and decoding.method not in METHODS:
                raise ValueError(f"unknown decoding method {decoding.method!r}; choose from {', '.join(METHODS)}")
        if self.streaming:
            self.open_stream()  # refuses settings the model cannot take; warns once of untrained chunks
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="konkanivani-decode")

    @property
    def description(self) -> dict:
        d = self.decoding
        info = {"model_format": "onnx" if self.exported else "checkpoint",
                "streaming": self.streaming, "method": d.method, "beam_size": d.beam_size}
        if self.streaming:
            info.update(chunk_size=d.chunk_size, chunk_ms=round(d.chunk_size * 40), left_chunks=d.left_chunks,
                        endpoint_ms=d.endpoint_ms)
        return info

    @property
    def notes(self) -> dict:
        """What ``/health`` says of the model beyond ``description``."""
        if not self.exported:
            return {}
        return {"note": "an ONNX export: CTC search only (greedy or beam) over model.onnx"
                        + (" and encoder_chunk.onnx" if self.streaming else "")
                        + "; no attention rescoring, as the decoder is not exported"}

    @property
    def why_not_streaming(self) -> str:
        if self.exported:
            return "the export has no encoder_chunk.onnx: export with --streaming"
        return "trained without --causal_conv"

    async def run(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` on a decode thread."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def open_stream(self, sample_rate: int = SAMPLE_RATE) -> Stream:
        d = self.decoding
        if self.exported:
            return self.recognizer.stream(d.method, d.beam_size, d.endpoint_ms, sample_rate)
        return self.recognizer.stream(d.chunk_size, d.left_chunks, d.method, d.beam_size, d.ctc_weight,
                                      endpoint_ms=d.endpoint_ms, sample_rate=sample_rate)

    @staticmethod
    def read_upload(data: bytes, max_seconds: float) -> torch.Tensor:
        """The 16 kHz mono waveform of an uploaded file's bytes, read in memory. ``AudioError`` when it
        cannot be read or is too short for the model; ``UploadTooLong`` beyond ``max_seconds`` (by its
        header, before decoding it, and as decoded)."""
        try:
            info = sf.info(io.BytesIO(data))
        except Exception as e:  # noqa: BLE001  soundfile raises LibsndfileError, RuntimeError, TypeError...
            raise AudioError("audio unreadable", UPLOAD, str(getattr(e, "error_string", e)).strip() or None) from e
        try:
            check_sample_rate(info.samplerate)
        except ValueError as e:
            raise AudioError("sample rate unsupported", UPLOAD, str(e)) from e
        if info.frames / info.samplerate > max_seconds:
            raise UploadTooLong(f"{info.frames / info.samplerate:.1f} s of audio: the server takes at most "
                                f"{max_seconds:g} s in one upload")
        wav = load_audio(io.BytesIO(data), label=UPLOAD)
        if len(wav) > max_seconds * SAMPLE_RATE:
            raise UploadTooLong(f"{len(wav) / SAMPLE_RATE:.1f} s of audio: the server takes at most "
                                f"{max_seconds:g} s in one upload")
        if len(wav) < MIN_SAMPLES:
            raise AudioError("audio too short", UPLOAD, f"{len(wav) / SAMPLE_RATE:.3f} s; the model needs at "
                             f"least {MIN_SAMPLES / SAMPLE_RATE:.3f} s")
        return wav

    def transcribe(self, wav: torch.Tensor) -> list[Result]:
        """The final results of a 16 kHz waveform (see the module): segments in order, the empty one
        only when no segment has text."""
        if self.streaming and not self.exported:
            stream = self.open_stream()
            return [r for r in stream.accept(wav) + stream.finish() if r.is_final]
        d, results = self.decoding, []
        weights = () if self.exported else (d.ctc_weight,)  # an export has no attention decoder to weigh CTC against
        for first, window in quiet_windows([wav]):
            if len(window) < MIN_SAMPLES:  # a last sliver of a window: too short to decode alone
                continue
            [text] = self.recognizer.decode_waveforms([window], d.method, d.beam_size, *weights)
            if text:
                results.append(Result(text, True, round(first / SAMPLE_RATE, 3),
                                      round((first + len(window)) / SAMPLE_RATE, 3)))
        return results or [Result("", True, 0.0, round(len(wav) / SAMPLE_RATE, 3))]
