"""Audio in, log-mel features out.

Audio is read with soundfile (torchaudio's own loader needs FFmpeg from 2.9 on), mixed down to
mono and resampled to 16 kHz; features are 80-dim log-mel frames, 25 ms windows every 10 ms.
Normalization (global CMVN) and SpecAugment live in the model (``model.py``), so they run batched
on the training device and a checkpoint carries its statistics.
"""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torchaudio

from ..config import ConfigError
from .frames import HOP_LENGTH, SAMPLE_RATE

__all__ = ["SAMPLE_RATE", "HOP_LENGTH", "LOG_OFFSET", "AudioError", "load_audio", "resample", "LogMel"]

LOG_OFFSET = 1e-6  # added to the mel power before the log, so that digital silence stays finite


class AudioError(RuntimeError):
    """Audio that cannot be used. ``reason`` is a fixed phrase that summaries count by ("audio file
    missing", "audio unreadable", "audio empty", "audio holds NaN or infinite samples", "segment
    outside its recording"); ``where`` names the file, ``detail`` says more (or is empty)."""

    def __init__(self, reason: str, where: str, detail: str = ""):
        super().__init__(f"{where}: {reason}" + (f" ({detail})" if detail else ""))
        self.reason, self.where, self.detail = reason, where, detail


def load_audio(source: str | Path | io.BytesIO, sample_rate: int = SAMPLE_RATE, start_s: float = 0.0,
               end_s: float | None = None, label: str | None = None) -> torch.Tensor:
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
                raise AudioError("segment outside its recording", label, f"from {start_s} s to "
                                 f"{'its end' if end_s is None else f'{end_s} s'} of {frames / sr:.2f} s")
            f.seek(start)
            data = f.read(stop - start, dtype="float32", always_2d=True)  # (N, channels)
    except AudioError:
        raise
    except Exception as e:  # noqa: BLE001  soundfile raises LibsndfileError, RuntimeError, TypeError...
        raise AudioError("audio unreadable", label, str(getattr(e, "error_string", e))) from e
    if data.shape[0] == 0:  # a header can promise frames that do not decode
        raise AudioError("audio empty", label)
    if not np.isfinite(data).all():  # a float file can hold NaN, which would turn into a NaN loss
        raise AudioError("audio holds NaN or infinite samples", label)
    return resample(torch.from_numpy(np.ascontiguousarray(data.mean(axis=1))), sr, sample_rate)  # (N,)


def resample(wav: torch.Tensor, sample_rate: int, target_rate: int = SAMPLE_RATE) -> torch.Tensor:
    """``wav`` (any shape, time last) at ``target_rate`` (torchaudio's windowed-sinc resampler)."""
    if sample_rate == target_rate:
        return wav
    return torchaudio.functional.resample(wav, sample_rate, target_rate)


class LogMel(torch.nn.Module):
    """Waveform ``(N,)`` at 16 kHz -> log-mel features ``(T, n_mels)``, T = 1 + N // 160.

    ``warp``, an ``(F, F)`` matrix over the power spectrum's frequency bins (VTLP in training,
    ``augment.vtlp_warp_matrix``), is applied between the spectrogram and the mel filterbank;
    without one the features are computed exactly as always.
    """

    def __init__(self, n_mels: int = 80):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(
            sample_rate=SAMPLE_RATE, n_fft=400, win_length=400, hop_length=HOP_LENGTH, n_mels=n_mels)

    @torch.no_grad()
    def forward(self, wav: torch.Tensor, warp: torch.Tensor | None = None) -> torch.Tensor:
        if warp is None:
            mel = self.mel(wav)
        else:
            mel = self.mel.mel_scale(warp @ self.mel.spectrogram(wav))  # (F, F) @ (F, T)
        return torch.log(mel + LOG_OFFSET).transpose(0, 1).contiguous()  # (T, n_mels)

    @property
    def n_freqs(self) -> int:
        """Frequency bins of the power spectrum (n_fft // 2 + 1)."""
        return self.mel.n_fft // 2 + 1


# The suffixes of audio files that folders are searched for (the importers, transcribe, --noise_dir):
# the common formats soundfile reads.
AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".aiff", ".aif", ".au", ".caf", ".w64", ".rf64")


def list_audio_files(folder: str | Path, flag: str) -> list[Path]:
    """The readable audio files under ``folder`` (recursively, sorted), checked by their headers;
    ``ConfigError`` naming the folder and ``flag`` when there is none."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"--{flag} {folder}: folder not found")
    files = []
    for path in sorted(p for p in folder.rglob("*") if p.suffix.lower() in AUDIO_SUFFIXES and p.is_file()):
        try:
            if sf.info(str(path)).frames > 0:
                files.append(path)
        except Exception:  # noqa: BLE001 (soundfile raises LibsndfileError, RuntimeError, TypeError...)
            continue
    if not files:
        raise ConfigError(f"--{flag} {folder}: no readable audio file in it (wav, flac, ogg, mp3, ...)")
    return files
