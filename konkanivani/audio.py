"""Audio in, log-mel features out.

Audio is read with soundfile (torchaudio's own loader needs FFmpeg from 2.9 on), mixed down to
mono and resampled to 16 kHz; features are 80-dim log-mel frames, 25 ms windows every 10 ms.
Normalization (global CMVN) and SpecAugment live in the model (``model.py``), so they run batched
on the training device and a checkpoint carries its statistics.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torchaudio

from .frames import HOP_LENGTH, SAMPLE_RATE

__all__ = ["SAMPLE_RATE", "HOP_LENGTH", "LOG_OFFSET", "load_audio", "resample", "LogMel"]

LOG_OFFSET = 1e-6  # added to the mel power before the log, so that digital silence stays finite


def load_audio(path: str | Path, sample_rate: int = SAMPLE_RATE) -> torch.Tensor:
    """Read any soundfile-supported file as a mono float32 waveform ``(N,)`` at ``sample_rate``.

    Raises ``RuntimeError`` naming the file when it cannot be decoded, holds no samples or
    non-finite ones.
    """
    if not Path(path).is_file():
        raise RuntimeError(f"cannot read audio {path}: file not found")
    try:
        data, sr = sf.read(str(path), dtype="float32", always_2d=True)  # (N, channels)
    except Exception as e:  # soundfile raises LibsndfileError, RuntimeError, TypeError...
        raise RuntimeError(f"cannot read audio {path}: {e}") from e
    if data.shape[0] == 0:
        raise RuntimeError(f"audio {path} holds no samples")
    if not np.isfinite(data).all():  # a float file can hold NaN, which would turn into a NaN loss
        raise RuntimeError(f"audio {path} holds NaN or infinite samples")
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
