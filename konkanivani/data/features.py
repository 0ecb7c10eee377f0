"""Features of 16 kHz audio: 80 bins, 25 ms windows every 10 ms, by one of two front-ends
(``ModelConfig.frontend``, ``make_frontend``): ``LogMel`` (the default) or ``KaldiFbank``.

``LogMel`` computes them for one waveform (decoding, streaming, CMVN) or for a padded batch of
waveforms (``LogMel.batch``: training, inside the step on the training device, where a GPU makes
them in a fraction of the time a CPU data worker takes). Both run the same transforms (torchaudio's
spectrogram and mel filterbank) with the same window and filters, and give the same numbers to
float rounding: each waveform of a batch is reflected at its own ends, as the one-waveform path
reflects its waveform, so no frame sees another utterance's padding. VTLP warps a batch's spectra
together (``alphas``). Normalization (CMVN) and SpecAugment live in the model.

``KaldiFbank`` is Kaldi's filterbank (``torchaudio.compliance.kaldi.fbank``) with the options
sherpa-onnx gives kaldi-native-fbank for a WeNet CTC model, so a deployment runtime computes the
features the model was trained on (``KALDI_FBANK``).
"""
from __future__ import annotations

import functools
import math
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
import torchaudio

from .augment import vtlp_warp_matrices
from .frames import (
    HOP_LENGTH,
    SAMPLE_RATE,
    frames_of_samples,
    kaldi_frames_of_samples,
    subsampled_lengths,
)

__all__ = ["LOG_OFFSET", "FRONTENDS", "KALDI_FBANK", "KALDI_FLOOR", "INT16_SCALE", "LogMel",
           "KaldiFbank",
           "make_frontend", "min_samples", "mel_bins_problem"]

LOG_OFFSET = 1e-6  # added to the mel power before the log, so that digital silence stays finite


FRONTENDS = ("log_mel", "kaldi_fbank")  # ModelConfig.frontend
# The least log power of a kaldi_fbank bin: below it, a bin is this. sherpa-onnx's offline
# recognizer dithers the samples (1 in 16-bit units), which turns digital silence (-15.9 here)
# into bins of up to 9.6 (five seconds of it; 4.3 on average), while a recording's own quiet lies
# above 12 (the demo corpus's noisy files, 5th percentile of their bins): with the floor between,
# both front-ends give silence the same features, and an utterance's mean does not move with the
# dither.
KALDI_FLOOR = 11.0
# sherpa-onnx's FeatureExtractorConfig defaults (sherpa-onnx/csrc/features.h), which its offline
# and online WeNet CTC recognizers keep but for the sample scale (INT16_SCALE) and, offline only,
# dither (1, in int16 units: a draw below any recording's noise floor, but not digital silence's).
# kaldi.fbank's own defaults differ in high_freq (0: Nyquist), snip_edges, the bins and energy.
KALDI_FBANK = {
    "sample_frequency": SAMPLE_RATE,
    "frame_length": 25.0,  # ms
    "frame_shift": 10.0,  # ms
    "dither": 0.0,
    "window_type": "povey",
    "snip_edges": False,
    "low_freq": 20.0,
    "high_freq": -400.0,  # 400 Hz below Nyquist, as lhotse's and icefall's
    "remove_dc_offset": True,
    "preemphasis_coefficient": 0.97,
    "round_to_power_of_two": True,
    "use_energy": False,
    "use_log_fbank": True,
    "use_power": True,
}
# sherpa-onnx feeds WeNet models samples in the range of 16-bit integers (normalize_samples false)
INT16_SCALE = 32768.0


class LogMel(torch.nn.Module):
    """Waveform ``(N,)`` at 16 kHz -> log-mel features ``(T, n_mels)``, T = 1 + N // 160.

    ``warp``, an ``(F, F)`` matrix over the power spectrum's frequency bins (VTLP in training,
    ``augment.vtlp_warp_matrices``), is applied between the spectrogram and the mel filterbank;
    without one the features are computed exactly as always.
    """

    name = "log_mel"

    def __init__(self, n_mels: int = 80):
        super().__init__()
        self.n_mels = n_mels
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

    @staticmethod
    def frames(samples: int) -> int:
        """Frames of ``samples`` samples: 1 + samples // 160 (``frames.frames_of_samples``)."""
        return frames_of_samples(samples)

    @property
    def min_samples(self) -> int:
        """The fewest samples whose frames make an encoder frame (``min_samples``): 960."""
        return min_samples(self)


class KaldiFbank(torch.nn.Module):
    """Waveform ``(N,)`` at 16 kHz -> Kaldi log filterbanks ``(T, n_mels)`` of the waveform scaled
    to 16-bit integers, at least ``KALDI_FLOOR``, T = (N + 80) // 160 (frame t covers samples
    160t - 120 .. 160t + 279, the ends reflected: ``snip_edges`` false). The same interface as
    ``LogMel``; VTLP goes through Kaldi's own VTLN warp of the filterbank (``vtln_warp``) instead
    of a warp of the spectrum, so ``forward`` takes none (decoding never warps)."""

    name = "kaldi_fbank"

    def __init__(self, n_mels: int = 80):
        super().__init__()
        self.n_mels = n_mels

    @torch.no_grad()
    def forward(self, wav: torch.Tensor, alpha: float = 1.0, snip_edges: bool = False
                ) -> torch.Tensor:
        """``snip_edges``: frames of ``wav``'s own samples alone, no reflection (a stream's
        frames, ``streaming.StreamingKaldiFbank``): 1 + (N - 400) // 160 of them."""
        options = {**KALDI_FBANK, "snip_edges": snip_edges}
        return torchaudio.compliance.kaldi.fbank(
            wav.float()[None] * INT16_SCALE, num_mel_bins=self.n_mels, vtln_warp=alpha, **options
        ).clamp_min(KALDI_FLOOR)

    @torch.no_grad()
    def batch(self, wavs: torch.Tensor, lengths: torch.Tensor,
              alphas: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``LogMel.batch``'s, utterance by utterance (kaldi.fbank takes one waveform), each warped
        by its VTLN factor (NaN: none)."""
        alphas = [math.nan] * len(wavs) if alphas is None else alphas.tolist()
        with torch.autocast(wavs.device.type, enabled=False):
            feats = [self(w[:n], a if math.isfinite(a) else 1.0)
                     for w, n, a in zip(wavs, lengths.tolist(), alphas)]
        frames = torch.tensor([len(f) for f in feats], device=wavs.device)
        out = torch.nn.utils.rnn.pad_sequence(feats, batch_first=True)
        # as many frames as the padded waveforms make (a batch padded by --pad_to_frames)
        return F.pad(out, (0, 0, 0, self.frames(wavs.shape[1]) - out.shape[1])), frames

    @staticmethod
    def frames(samples: int) -> int:
        """Frames of ``samples`` samples: (samples + 80) // 160 (Kaldi's, without snip_edges:
        ``frames.kaldi_frames_of_samples``)."""
        return kaldi_frames_of_samples(samples)

    @property
    def min_samples(self) -> int:
        """The fewest samples whose frames make an encoder frame (``min_samples``): 1040."""
        return min_samples(self)


def min_samples(frontend: LogMel | KaldiFbank | type) -> int:
    """The fewest samples the encoder decodes with ``frontend``'s features (a front-end or its
    class: ``frames`` is all it asks): its subsampling
    (``frames.subsampled_lengths``) needs 7 frames for one encoder frame; fewer make its
    convolutions fail."""
    samples = 0
    while subsampled_lengths(frontend.frames(samples)) < 1:
        samples += 1
    return samples


def make_frontend(name: str, n_mels: int) -> LogMel | KaldiFbank:
    """The front-end ``ModelConfig.frontend`` names."""
    if name not in FRONTENDS:
        raise ValueError(f"unknown front-end {name!r}; choose from {', '.join(FRONTENDS)}")
    return KaldiFbank(n_mels) if name == "kaldi_fbank" else LogMel(n_mels)


# Frequency bins of each front-end's power spectrum that its mel filters are made of: LogMel's
# n_fft of 400 (n_fft // 2 + 1), Kaldi's 400-sample window padded to 512 (its filters leave out
# the Nyquist bin); and the fewest filters Kaldi makes.
SPECTRUM_BINS = {"log_mel": 201, "kaldi_fbank": 256}
KALDI_MIN_BINS = 4


def _empty_filters(frontend: str, n_mels: int) -> int:
    """How many of ``frontend``'s ``n_mels`` mel filters take nothing from any spectrum bin (their
    feature is a constant), computed from the filterbank the front-end builds."""
    if frontend == "kaldi_fbank":
        banks, _ = torchaudio.compliance.kaldi.get_mel_banks(
            n_mels, 512, float(SAMPLE_RATE), KALDI_FBANK["low_freq"], KALDI_FBANK["high_freq"],
            100.0, -500.0, 1.0)  # kaldi.fbank's vtln_low and vtln_high, no warp
        return int((banks.amax(dim=1) == 0).sum())
    with warnings.catch_warnings():  # torchaudio's own warning of empty filters: counted here
        warnings.simplefilter("ignore")
        banks = torchaudio.functional.melscale_fbanks(SPECTRUM_BINS["log_mel"], 0.0,
                                                      SAMPLE_RATE / 2, n_mels, SAMPLE_RATE)
    return int((banks.amax(dim=0) == 0).sum())


def mel_bins_problem(frontend: str, n_mels: int) -> tuple[Optional[str], Optional[str]]:
    """``(refusal, warning)`` for ``n_mels`` bins of ``frontend``, each None when there is none:
    more bins than its spectrum has (or fewer than Kaldi makes) are refused; bins some of whose
    filters hold no frequency are warned about, with the most that all hold one."""
    bins = SPECTRUM_BINS[frontend]
    if frontend == "kaldi_fbank" and n_mels < KALDI_MIN_BINS:
        return (f"--n_mels {n_mels}: the kaldi_fbank front-end makes at least {KALDI_MIN_BINS} "
                "mel bins"), None
    if n_mels > bins:
        return (f"--n_mels {n_mels}: the {frontend} front-end's spectrum has {bins} frequency "
                f"bins to make mel bins of, and at most {_most_full(frontend)} mel bins that each "
                "hold a frequency (80 is usual)"), None
    empty = _empty_filters(frontend, n_mels)
    if not empty:
        return None, None
    return None, (f"--n_mels {n_mels}: {empty} of the {frontend} front-end's {n_mels} mel bins "
                  f"{'holds' if empty == 1 else 'hold'} no frequency of its {bins}-bin "
                  f"spectrum (their features are constant); {_most_full(frontend)} is the most "
                  "without any")


@functools.cache
def _most_full(frontend: str) -> int:
    """The most mel bins of ``frontend`` that each hold a frequency (filters only narrow as they
    grow in number: a bisection)."""
    good, bad = KALDI_MIN_BINS, SPECTRUM_BINS[frontend] + 1
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (good, mid) if _empty_filters(frontend, mid) else (mid, bad)
    return good


def _reflected(wavs: torch.Tensor, lengths: torch.Tensor, half: int) -> torch.Tensor:
    """``(B, N)`` -> ``(B, N + 2 * half)``: each waveform with ``half`` samples reflected about its
    first and about its last sample (``torch.stft``'s ``center`` padding, at each one's own length);
    what lies beyond is filler that only padding frames read."""
    # (1, N + 2h)
    position = torch.arange(-half, wavs.shape[1] + half, device=wavs.device).abs()[None, :]
    last = (lengths.to(wavs.device) - 1)[:, None]  # (B, 1)
    index = torch.where(position > last, 2 * last - position, position)  # reflected at the end
    return wavs.gather(1, index.clamp(0, wavs.shape[1] - 1))
