"""Audio in: read with soundfile (torchaudio's own loader needs FFmpeg from 2.9 on), mixed down to
mono and resampled to 16 kHz, whole or block by block; the folders of audio files. Features are
``features.LogMel``'s.
"""
from __future__ import annotations

import io
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torchaudio

from ..config import ConfigError
from .frames import HOP_LENGTH, SAMPLE_RATE

__all__ = ["SAMPLE_RATE", "HOP_LENGTH", "AudioError", "load_audio", "read_blocks", "resample",
           "Resampler"]

class AudioError(RuntimeError):
    """Audio that cannot be used. ``reason`` is a fixed phrase that summaries count by ("audio file
    missing", "audio unreadable", "audio empty", "audio holds NaN or infinite samples", "segment
    outside its recording"); ``where`` names the file, ``detail`` says more (or is empty)."""

    def __init__(self, reason: str, where: str, detail: str = ""):
        super().__init__(f"{where}: {reason}" + (f" ({detail})" if detail else ""))
        self.reason, self.where, self.detail = reason, where, detail


def load_audio(
    source: str | Path | io.BytesIO,
    sample_rate: int = SAMPLE_RATE,
    start_s: float = 0.0,
    end_s: float | None = None,
    label: str | None = None,
) -> torch.Tensor:
    """Read any soundfile-supported file (or in-memory bytes) as a mono float32 waveform ``(N,)`` at
    ``sample_rate``, from ``start_s`` to ``end_s`` seconds (its end when None or past it); only that
    span is decoded. ``label`` names the source in messages (default: its path).

    Raises ``AudioError`` (a ``RuntimeError``) naming the file when it is missing, cannot be
    decoded, holds no samples (in that span) or non-finite ones.
    """
    label = label or str(source)
    if not isinstance(source, io.BytesIO) and not Path(source).is_file():
        raise AudioError("audio file missing", label)
    try:
        with sf.SoundFile(source if isinstance(source, io.BytesIO) else str(source)) as f:
            sr, frames = f.samplerate, f.frames
            start = round(start_s * sr)
            stop = frames if end_s is None else min(round(end_s * sr), frames)
            if frames == 0:
                raise AudioError("audio empty", label)
            if not 0 <= start < stop:
                raise AudioError(
                    "segment outside its recording",
                    label,
                    f"from {start_s} s to "
                    f"{'its end' if end_s is None else f'{end_s} s'} of {frames / sr:.2f} s",
                )
            f.seek(start)
            data = f.read(stop - start, dtype="float32", always_2d=True)  # (N, channels)
    except AudioError:
        raise
    # soundfile raises LibsndfileError, RuntimeError, TypeError...
    except Exception as e:  # noqa: BLE001
        raise AudioError("audio unreadable", label, str(getattr(e, "error_string", e))) from e
    if data.shape[0] == 0:  # a header can promise frames that do not decode
        raise AudioError("audio empty", label)
    if not np.isfinite(data).all():  # a float file can hold NaN, which would turn into a NaN loss
        raise AudioError("audio holds NaN or infinite samples", label)
    # (N,)
    return resample(torch.from_numpy(np.ascontiguousarray(data.mean(axis=1))), sr, sample_rate)


def resample(wav: torch.Tensor, sample_rate: int, target_rate: int = SAMPLE_RATE) -> torch.Tensor:
    """``wav`` (any shape, time last) at ``target_rate`` (torchaudio's windowed-sinc resampler)."""
    if sample_rate == target_rate:
        return wav
    return torchaudio.functional.resample(wav, sample_rate, target_rate)


class Resampler:
    """``resample`` of a waveform that comes in pieces, piece by piece: the pieces it returns, put
    together, are what ``resample`` makes of the whole (to float rounding). The sinc filter reaches
    a few input samples to each side, so each call keeps back the input whose output needs samples
    not yet given (a few milliseconds), and ``flush`` gives the rest at the end.

    >>> r = Resampler(8000)
    >>> wav = torch.randn(8000)
    >>> pieces = [r(p) for p in wav.split(1234)] + [r.flush()]
    >>> bool(torch.allclose(torch.cat(pieces), resample(wav, 8000), atol=1e-5))
    True
    """

    def __init__(self, sample_rate: int, target_rate: int = SAMPLE_RATE):
        self.sample_rate, self.target_rate = sample_rate, target_rate
        gcd = math.gcd(sample_rate, target_rate)
        # input, output samples per step
        self.period, self.out_period = sample_rate // gcd, target_rate // gcd
        # torchaudio's filter reaches ceil(6 * period / (0.99 * min(period, out_period))) samples to
        # each side of a step, and a step spans one period: whole periods that cover both.
        self.context = self.period * (math.ceil(7 / min(self.period, self.out_period)) + 1)
        # The input not yet resampled, after the `context` samples before it (zeros at the start, as
        # `resample` pads the waveform's start).
        self.buffer = torch.zeros(self.context)

    def __call__(self, piece: torch.Tensor) -> torch.Tensor:
        if self.sample_rate == self.target_rate:
            return piece
        self.buffer = torch.cat([self.buffer, piece])
        # the whole steps it can give
        ready = (len(self.buffer) - 2 * self.context) // self.period * self.period
        if ready <= 0:
            return self.buffer[:0]
        out = self._resample(self.buffer[: ready + 2 * self.context])[
            : ready // self.period * self.out_period
        ]
        self.buffer = self.buffer[ready:]
        return out

    def flush(self) -> torch.Tensor:
        """The output of what remains (the end of the waveform)."""
        if self.sample_rate == self.target_rate or len(self.buffer) == self.context:
            return self.buffer[:0]
        out = self._resample(self.buffer)
        self.buffer = self.buffer[len(self.buffer) - self.context:]
        return out

    def _resample(self, wav: torch.Tensor) -> torch.Tensor:
        """``wav`` resampled, without the output of its first ``context`` samples."""
        return resample(wav, self.sample_rate, self.target_rate)[
            self.context // self.period * self.out_period :
        ]


def read_blocks(source: str | Path | io.BytesIO, seconds: float = 1.0,
                sample_rate: int = SAMPLE_RATE, label: str | None = None
                ) -> Iterator[torch.Tensor]:
    """The waveform of a file as ``load_audio`` gives it (mono float32 at ``sample_rate``), in
    blocks of about ``seconds``, read one at a time (``soundfile``'s ``blocks``) and resampled piece
    by piece (``Resampler``): a recording of any length in the memory of a block, each channel
    mixed down as its block is read. ``source``: a path, or a file's bytes. Put together, the
    blocks are ``load_audio(source)`` to float rounding. Raises ``AudioError`` as ``load_audio``
    does, for
    a file that turns out to be unreadable or non-finite part way too."""
    label = label or str(source)
    in_memory = isinstance(source, io.BytesIO)  # an upload's bytes
    if not in_memory and not Path(source).is_file():
        raise AudioError("audio file missing", label)
    try:
        f = sf.SoundFile(source if in_memory else str(source))
    # soundfile raises LibsndfileError, RuntimeError, TypeError...
    except Exception as e:  # noqa: BLE001
        raise AudioError("audio unreadable", label, str(getattr(e, "error_string", e))) from e
    with f:
        if f.frames == 0:
            raise AudioError("audio empty", label)
        resampler = Resampler(f.samplerate, sample_rate)
        blocks = f.blocks(
            blocksize=max(1, round(seconds * f.samplerate)), dtype="float32", always_2d=True
        )
        while True:
            try:
                block = next(blocks, None)
            except Exception as e:  # noqa: BLE001  as above
                raise AudioError(
                    "audio unreadable", label, str(getattr(e, "error_string", e))
                ) from e
            if block is None:
                break
            if not np.isfinite(block).all():
                raise AudioError("audio holds NaN or infinite samples", label)
            out = resampler(torch.from_numpy(np.ascontiguousarray(block.mean(axis=1))))
            if len(out):
                yield out
        out = resampler.flush()
        if len(out):
            yield out


# The suffixes of audio files that folders are searched for (the importers, transcribe,
# --noise_dir): the common formats soundfile reads.
AUDIO_SUFFIXES = (
    ".wav",
    ".flac",
    ".ogg",
    ".oga",
    ".opus",
    ".mp3",
    ".aiff",
    ".aif",
    ".au",
    ".caf",
    ".w64",
    ".rf64",
)


def list_audio_files(folder: str | Path, flag: str) -> list[Path]:
    """The readable audio files under ``folder`` (recursively, sorted), checked by their headers;
    ``ConfigError`` naming the folder and ``flag`` when there is none."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"--{flag} {folder}: folder not found")
    files = []
    for path in sorted(
        p for p in folder.rglob("*") if p.suffix.lower() in AUDIO_SUFFIXES and p.is_file()
    ):
        try:
            if sf.info(str(path)).frames > 0:
                files.append(path)
        # soundfile raises LibsndfileError, RuntimeError, TypeError...
        except Exception:  # noqa: BLE001
            continue
    if not files:
        raise ConfigError(
            f"--{flag} {folder}: no readable audio file in it (wav, flac, ogg, mp3, ...)"
        )
    return files
