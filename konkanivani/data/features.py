"""Log-mel features: 80 bins, 25 ms windows every 10 ms, of 16 kHz audio.

``LogMel`` computes them for one waveform (decoding, streaming, CMVN) or for a padded batch of
waveforms (``LogMel.batch``: training, inside the step on the training device, where a GPU makes
them in a fraction of the time a CPU data worker takes). Both run the same transforms (torchaudio's
spectrogram and mel filterbank) with the same window and filters, and give the same numbers to
float rounding: each waveform of a batch is reflected at its own ends, as the one-waveform path
reflects its waveform, so no frame sees another utterance's padding. VTLP warps a batch's spectra
together (``alphas``). Normalization (CMVN) and SpecAugment live in the model.
"""
from __future__ import annotations

from typing import Optional

import torch
import torchaudio

from .augment import vtlp_warp_matrices
from .frames import HOP_LENGTH, SAMPLE_RATE

__all__ = ["LOG_OFFSET", "LogMel"]

LOG_OFFSET = 1e-6  # added to the mel power before the log, so that digital silence stays finite


class LogMel(torch.nn.Module):
    """Waveform ``(N,)`` at 16 kHz -> log-mel features ``(T, n_mels)``, T = 1 + N // 160.

    ``warp``, an ``(F, F)`` matrix over the power spectrum's frequency bins (VTLP in training,
    ``augment.vtlp_warp_matrix``), is applied between the spectrogram and the mel filterbank;
    without one the features are computed exactly as always.
    """

    def __init__(self, n_mels: int = 80):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(
            sample_rate=SAMPLE_RATE, n_fft=400, win_length=400, hop_length=HOP_LENGTH, n_mels=n_mels
        )

    @torch.no_grad()
    def forward(self, wav: torch.Tensor, warp: torch.Tensor | None = None) -> torch.Tensor:
        if warp is None:
            mel = self.mel(wav)
        else:
            mel = self.mel.mel_scale(warp @ self.mel.spectrogram(wav))  # (F, F) @ (F, T)
        return torch.log(mel + LOG_OFFSET).transpose(0, 1).contiguous()  # (T, n_mels)

    @torch.no_grad()
    def batch(self, wavs: torch.Tensor, lengths: torch.Tensor,
              alphas: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The features of a padded batch, on its device, in float32 whatever autocast says.

        Args:
            wavs: ``(B, N)`` waveforms, zero-padded after their ``lengths`` ``(B,)`` samples (each
                longer than half a window, 200 samples, as every usable utterance is).
            alphas: ``(B,)`` VTLP warp factors; NaN (or 1) where an utterance is not warped.
        Returns:
            ``(B, T, n_mels)`` features, zero after each utterance's ``1 + length // 160`` frames,
            and those ``(B,)`` frame counts.
        """
        spectrogram = self.mel.spectrogram
        half = spectrogram.n_fft // 2
        with torch.autocast(wavs.device.type, enabled=False):
            padded = _reflected(wavs.float(), lengths, half)  # (B, N + 2 * half)
            spec = torchaudio.functional.spectrogram(
                padded,
                pad=0,
                window=spectrogram.window,
                n_fft=spectrogram.n_fft,
                hop_length=spectrogram.hop_length,
                # (B, F, T)
                win_length=spectrogram.win_length,
                power=2.0,
                normalized=False,
                center=False,
            )
            # every utterance through its matrix (the identity for NaN and 1):
            if alphas is not None:
                # picking out the warped ones would make the host wait for the device to count them
                alphas = torch.where(torch.isfinite(alphas), alphas, 1.0).to(spec.device)
                spec = vtlp_warp_matrices(alphas, spec.shape[1]) @ spec  # (B, F, F) @ (B, F, T)
            # (B, T, n_mels)
            feats = torch.log(self.mel.mel_scale(spec) + LOG_OFFSET).transpose(1, 2)
        frames = 1 + lengths // spectrogram.hop_length
        # (B, T)
        padding = torch.arange(feats.shape[1], device=feats.device)[None, :] >= frames[:, None]
        return feats.masked_fill(padding[..., None], 0.0), frames

    @property
    def n_freqs(self) -> int:
        """Frequency bins of the power spectrum (n_fft // 2 + 1)."""
        return self.mel.n_fft // 2 + 1


def _reflected(wavs: torch.Tensor, lengths: torch.Tensor, half: int) -> torch.Tensor:
    """``(B, N)`` -> ``(B, N + 2 * half)``: each waveform with ``half`` samples reflected about its
    first and about its last sample (``torch.stft``'s ``center`` padding, at each one's own length);
    what lies beyond is filler that only padding frames read."""
    # (1, N + 2h)
    position = torch.arange(-half, wavs.shape[1] + half, device=wavs.device).abs()[None, :]
    last = (lengths.to(wavs.device) - 1)[:, None]  # (B, 1)
    index = torch.where(position > last, 2 * last - position, position)  # reflected at the end
    return wavs.gather(1, index.clamp(0, wavs.shape[1] - 1))
