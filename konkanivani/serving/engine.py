"""The recognizer a server holds, loaded once and only read, and how the server decodes with it.

Decoding is CPU-bound, so none of it runs on the event loop: ``Engine.run`` hands a call to a pool
of ``workers`` decode threads (one by default: PyTorch's own threads already use every core), and
the loop stays free to answer ``/health`` and to read the next frames while a chunk decodes.

A streaming checkpoint (trained with ``--causal_conv``) decodes an upload as
``konkanivani-transcribe --chunk_size`` does a file: through a stream, in segments that end at
pauses, with word times. Any other checkpoint decodes it as that tool does a long file: in windows
of at most 20 s cut at quiet moments (``quiet_windows``), each decoded whole with ``method``; it
cannot stream (``/stream`` says so).

An export folder (``decoding.exported.ExportedRecognizer``, onnxruntime) decodes uploads in those
windows through ``model.onnx`` with ``greedy`` or ``beam`` (no attention decoder: nothing rescored),
and streams through ``encoder_chunk.onnx`` when it has it, in the chunks it was exported for.
"""
from __future__ import annotations

import asyncio
import dataclasses
import io
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

import soundfile as sf
import torch

from ..data.audio import AudioError, load_audio
from ..data.frames import SAMPLE_RATE
from ..decoding.onnx_recognizer import ExportedRecognizer
from ..decoding.recognizer import MIN_SAMPLES, Recognizer
from ..decoding.settings import DecodingConfig
from ..decoding.streaming import FRAME_SECONDS, Result, Stream, check_sample_rate, quiet_windows

__all__ = ["Engine", "UploadTooLong"]

T = TypeVar("T")
UPLOAD = "the upload"  # how messages name an uploaded file: never by a name the client chose


class UploadTooLong(ValueError):
    """An upload holds more audio than the server takes (``Limits.max_upload_seconds``)."""


class Engine:
    """A recognizer (a checkpoint's, or an export folder's) and its ``DecodingConfig``, checked and
    resolved once for it (``ValueError`` in one line): ``decoding`` holds the settings it decodes
    with. ``streaming`` says whether the model can stream; one that cannot decodes whole windows,
    with no chunk (the chunk settings are a stream's)."""

    def __init__(self, recognizer: Recognizer | ExportedRecognizer,
                 decoding: DecodingConfig | None = None, workers: int = 1):
        self.recognizer = recognizer
        self.exported = isinstance(recognizer, ExportedRecognizer)
        if self.exported:
            self.streaming = recognizer.streaming is not None
        else:
            self.streaming = bool(recognizer.model.cfg.causal_conv)
            for p in recognizer.model.parameters():  # read-only: no request can train or change it
                p.requires_grad_(False)
        decoding = decoding or DecodingConfig()
        if not self.streaming:
            decoding = dataclasses.replace(decoding, chunk_size=0, left_chunks=-1, endpoint_ms=None)
        self.decoding = recognizer.settings(decoding, streams=self.streaming)
        if self.streaming:
            # refuses settings the model cannot take; warns once of untrained chunks
            self.open_stream()
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="konkanivani-decode")

    @property
    def description(self) -> dict:
        d = self.decoding
        info = {"model_format": "onnx" if self.exported else "checkpoint",
                "streaming": self.streaming, "method": d.method, "beam_size": d.beam_size}
        if self.streaming:
            chunk_ms = round(d.chunk_size * FRAME_SECONDS * 1000)
            info.update(chunk_size=d.chunk_size, chunk_ms=chunk_ms, left_chunks=d.left_chunks,
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
        return self.recognizer.stream(self.decoding, sample_rate=sample_rate)

    @staticmethod
    def read_upload(data: bytes, max_seconds: float) -> torch.Tensor:
        """The 16 kHz mono waveform of an uploaded file's bytes, read in memory. ``AudioError`` when
        it cannot be read or is too short for the model; ``UploadTooLong`` beyond ``max_seconds``
        (by its
        header, before decoding it, and as decoded)."""
        try:
            info = sf.info(io.BytesIO(data))
        # soundfile raises LibsndfileError, RuntimeError, TypeError...
        except Exception as e:  # noqa: BLE001
            raise AudioError(
                "audio unreadable", UPLOAD, str(getattr(e, "error_string", e)).strip() or None
            ) from e
        try:
            check_sample_rate(info.samplerate)
        except ValueError as e:
            raise AudioError("sample rate unsupported", UPLOAD, str(e)) from e
        if info.frames / info.samplerate > max_seconds:
            raise UploadTooLong(
                f"{info.frames / info.samplerate:.1f} s of audio: the server takes at most "
                f"{max_seconds:g} s in one upload"
            )
        wav = load_audio(io.BytesIO(data), label=UPLOAD)
        if len(wav) > max_seconds * SAMPLE_RATE:
            raise UploadTooLong(
                f"{len(wav) / SAMPLE_RATE:.1f} s of audio: the server takes at most "
                f"{max_seconds:g} s in one upload"
            )
        if len(wav) < MIN_SAMPLES:
            raise AudioError(
                "audio too short",
                UPLOAD,
                f"{len(wav) / SAMPLE_RATE:.3f} s; the model needs at "
                f"least {MIN_SAMPLES / SAMPLE_RATE:.3f} s",
            )
        return wav

    def transcribe(self, wav: torch.Tensor) -> list[Result]:
        """The final results of a 16 kHz waveform (see the module): segments in order, the empty one
        only when no segment has text."""
        if self.streaming and not self.exported:
            stream = self.open_stream()
            return [r for r in stream.accept(wav) + stream.finish() if r.is_final]
        results = []
        for first, window in quiet_windows([wav]):
            if len(window) < MIN_SAMPLES:  # a last sliver of a window: too short to decode alone
                continue
            [text] = self.recognizer.decode_waveforms([window], self.decoding)
            if text:
                results.append(Result(text, True, round(first / SAMPLE_RATE, 3),
                                      round((first + len(window)) / SAMPLE_RATE, 3)))
        return results or [Result("", True, 0.0, round(len(wav) / SAMPLE_RATE, 3))]
