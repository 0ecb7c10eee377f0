"""On-the-fly data augmentation of training audio: speed perturbation, additive noise, reverberation
and vocal-tract-length perturbation (VTLP).

Everything here runs in the DataLoader workers, one utterance at a time, before (speed, reverb,
noise) or inside (VTLP) the log-mel computation. Every random draw of an utterance comes from a
generator seeded by ``(seed, epoch, utterance index, augmentation)`` alone
(``utterance_generator``), never from the global RNG or the worker's: the same seed gives the same
features whatever the number of workers or the order they run in, each epoch draws afresh, and a
resumed run sees exactly the augmentations an unbroken one would. Each augmentation has a stream of
its own, so turning one on or off leaves the others' draws as they were.

``corrupt_manifest`` writes a noisy and reverberant copy of a manifest (a harder test set).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import math
from pathlib import Path
from typing import Optional

import soundfile as sf
import torch
import torchaudio

from ..config import AugmentConfig
from .audio import list_audio_files, load_audio, resample
from .frames import SAMPLE_RATE, ctc_frames_of_samples

__all__ = [
    "ramp_done",
    "SPEED_FACTORS",
    "VTLP_RANGE",
    "vtlp_warp_matrices",
    "Augmenter",
    "utterance_generator",
    "speed_perturb",
    "coloured_noise",
    "add_noise",
    "synthetic_rir",
    "reverberate",
    "batching_duration",
]

log = logging.getLogger("konkanivani")

SPEED_FACTORS = (0.9, 1.0, 1.1)  # Kaldi/ESPnet 3-way speed perturbation
VTLP_RANGE = (0.9, 1.1)  # warp factor alpha (Jaitly & Hinton 2013)
# J&H's F_hi: the warp is linear (f * alpha) up to about here, then meets Nyquist
VTLP_HIGH_HZ = 4800.0
RT60_RANGE_S = (0.2, 0.9)  # reverberation time of the synthetic rooms
DRR_RANGE_DB = (0.0, 10.0)  # direct-to-reverberant energy ratio of the synthetic rooms
NOISE_SLOPE_RANGE = (0.0, 2.0)  # power spectrum ~ 1/f^slope: 0 white, 1 pink, 2 brown
BABBLE_PROB = 0.5  # share of generated noises whose level fluctuates at syllable rate, like babble
BABBLE_RATE_HZ = (2.0, 8.0)


# ---- seeding ------------------------------------------------------------------------------------

def utterance_generator(seed: int, epoch: int, index: int, stream: str) -> torch.Generator:
    """A torch generator for one augmentation (``stream``) of one utterance in one epoch. Hashing
    the key (not ``hash()``, which differs between processes) makes it the same in every worker and
    every run, and unrelated between neighbouring keys."""
    digest = hashlib.blake2b(f"{seed}/{epoch}/{index}/{stream}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def _uniform(gen: torch.Generator, low: float, high: float) -> float:
    return low + (high - low) * float(torch.rand((), generator=gen, dtype=torch.float64))


def _chance(gen: torch.Generator, p: float) -> bool:
    """True with probability ``p``; always draws one number, so that the draws after it do not
    depend on ``p``."""
    return float(torch.rand((), generator=gen, dtype=torch.float64)) < p


def _randint(gen: torch.Generator, high: int) -> int:
    """An integer in [0, high)."""
    return int(torch.randint(high, (), generator=gen))


# ---- speed --------------------------------------------------------------------------------------

def speed_perturb(wav: torch.Tensor, factor: float) -> torch.Tensor:
    """``wav`` played ``factor`` times as fast, tempo and pitch together (Kaldi's ``sox speed``):
    read as if sampled at ``factor`` x 16 kHz and resampled to 16 kHz, so that it has about
    ``len(wav) / factor`` samples (rounded up)."""
    if factor == 1.0:
        return wav
    return torchaudio.functional.resample(wav, round(SAMPLE_RATE * factor), SAMPLE_RATE)


def batching_duration(duration: float, speed_perturbation: bool) -> float:
    """The duration the batch samplers plan an utterance with.

    The samplers fix an epoch's batches from manifest durations before any audio is read, and the
    speed factor of an utterance is drawn in the worker. Rather than tie the samplers to the
    augmentation's draws, they plan every utterance at its longest: slowed down by the lowest factor
    (0.9 -> 1/0.9 as long), plus one sample for the resampler's rounding up. A batch then never goes
    over its --max_batch_frames / --max_memory_gb budget, at the price of batches about 10% smaller
    than the budget allows for the utterances that were not slowed down.
    """
    if not speed_perturbation:
        return duration
    return duration / min(SPEED_FACTORS) + 1.0 / SAMPLE_RATE


# ---- noise --------------------------------------------------------------------------------------

def coloured_noise(num_samples: int, gen: torch.Generator) -> torch.Tensor:
    """Gaussian noise of ``num_samples`` with a random spectral slope (white to brown), and half
    of the time a level that rises and falls at syllable rate, a crude stand-in for babble."""
    white = torch.randn(num_samples, generator=gen)
    slope = _uniform(gen, *NOISE_SLOPE_RANGE)
    freqs = torch.fft.rfftfreq(num_samples, d=1.0 / SAMPLE_RATE)
    shape = freqs.clamp_min(20.0) ** (-slope / 2)  # amplitude ~ f^(-slope/2): power ~ f^-slope
    noise = torch.fft.irfft(torch.fft.rfft(white) * shape, n=num_samples)
    if _chance(gen, BABBLE_PROB):  # a random level every 1/rate seconds, interpolated
        points = max(2, math.ceil(num_samples / SAMPLE_RATE * _uniform(gen, *BABBLE_RATE_HZ)) + 1)
        envelope = torch.rand(points, generator=gen) + 0.1
        noise = (
            noise
            * torch.nn.functional.interpolate(
                envelope[None, None], size=num_samples, mode="linear", align_corners=True
            )[0, 0]
        )
    return noise


def _noise_excerpt(path: Path, num_samples: int, gen: torch.Generator) -> torch.Tensor:
    """``num_samples`` of the noise file at 16 kHz from a random offset; a file that is too short
    is looped from a random point. Only the excerpt is read and resampled."""
    info = sf.info(str(path))
    need = math.ceil(num_samples * info.samplerate / SAMPLE_RATE) + 1
    if info.frames > need:
        start = _randint(gen, info.frames - need + 1)
        data, sr = sf.read(str(path), start=start, frames=need, dtype="float32", always_2d=True)
        wav = resample(torch.from_numpy(data.mean(axis=1)), sr)
        if not bool(torch.isfinite(wav).all()):  # as load_audio refuses such a file whole
            raise RuntimeError(f"audio {path} holds NaN or infinite samples")
    else:
        wav = load_audio(path)
        wav = torch.roll(wav, _randint(gen, len(wav))).repeat(math.ceil(num_samples / len(wav)) + 1)
    return wav[:num_samples].contiguous()


def add_noise(wav: torch.Tensor, noise: torch.Tensor, snr_db: float) -> torch.Tensor:
    """``wav`` plus ``noise`` (same length) scaled to ``snr_db`` dB below the signal's energy
    (``torchaudio.functional.add_noise``). Silence stays silent; silent noise adds nothing."""
    if not bool(noise.any()):
        return wav
    return torchaudio.functional.add_noise(wav, noise, torch.tensor(snr_db, dtype=wav.dtype))


# ---- reverberation ------------------------------------------------------------------------------

def synthetic_rir(gen: torch.Generator) -> torch.Tensor:
    """A room impulse response: a unit direct path, then exponentially decaying Gaussian noise
    (a diffuse tail) with a random RT60 and direct-to-reverberant ratio."""
    rt60 = _uniform(gen, *RT60_RANGE_S)
    drr_db = _uniform(gen, *DRR_RANGE_DB)
    length = int(rt60 * SAMPLE_RATE)
    t = torch.arange(1, length) / SAMPLE_RATE
    # -60 dB at rt60
    tail = torch.randn(length - 1, generator=gen) * torch.exp(-3 * math.log(10) * t / rt60)
    tail = tail * math.sqrt(10 ** (-drr_db / 10) / float(tail.pow(2).sum()))
    return torch.cat([torch.ones(1), tail])


def reverberate(wav: torch.Tensor, rir: torch.Tensor) -> torch.Tensor:
    """``wav`` convolved with ``rir``, aligned on the direct path (the RIR's strongest tap: no delay
    before it, nothing added to the length) and scaled back to ``wav``'s RMS level."""
    direct = int(rir.abs().argmax())
    wet = torchaudio.functional.fftconvolve(wav, rir / rir.abs().max())[direct:direct + len(wav)]
    level, wet_level = wav.pow(2).mean().sqrt(), wet.pow(2).mean().sqrt()
    return wet * (level / wet_level) if wet_level > 0 else wet


@functools.lru_cache(maxsize=512)
def _load_rir(path: Path) -> torch.Tensor:
    """An RIR file at 16 kHz, cached in each worker (RIRs are short and drawn again and again)."""
    rir = load_audio(path)
    if not bool(rir.any()):
        raise RuntimeError(f"room impulse response {path} is all zeros")
    return rir


# ---- ramps --------------------------------------------------------------------------------------

def ramp_done(done: int, steps: int) -> float:
    """How far a straight-line ramp over ``steps`` units is after ``done`` of them, 0 to 1 (1 from
    the start when ``steps`` is 0). Every ramp of training is this one: the augmentation
    curriculum's probabilities over epochs (``Augmenter.ramped``), SpecAugment's widths and the
    loss weights over optimizer steps (``training.objective``)."""
    return min(done / steps, 1.0) if steps else 1.0


# ---- VTLP ---------------------------------------------------------------------------------------

def vtlp_warp_matrices(alphas: torch.Tensor, n_freqs: int) -> torch.Tensor:
    """``(K,)`` warp factors -> ``(K, n_freqs, n_freqs)`` float32 matrices, built together on the
    factors' device (the training step warps a batch's spectra there). Matrix W of factor alpha
    warps a power spectrum's frequency axis: ``W @ spec`` moves what was at f to f' = alpha * f
    below the boundary (``VTLP_HIGH_HZ * min(alpha, 1)``) and maps the rest linearly onto the band
    up to Nyquist (Jaitly & Hinton 2013, eq. 1). Each output bin reads the input at the inverse
    warp, interpolating linearly between bins; alpha = 1 gives the identity (within rounding)."""
    nyquist = SAMPLE_RATE / 2
    alphas = alphas.double()[:, None]  # (K, 1)
    out_freqs = torch.linspace(0, nyquist, n_freqs, dtype=torch.float64, device=alphas.device)
    edge_out = VTLP_HIGH_HZ * alphas.clamp(max=1.0)  # f' at the boundary
    edge_in = edge_out / alphas
    below = out_freqs / alphas
    above = nyquist - (nyquist - out_freqs) * (nyquist - edge_in) / (nyquist - edge_out)
    # (K, F) input bin
    position = torch.where(out_freqs <= edge_out, below, above) / nyquist * (n_freqs - 1)
    low = position.floor().long().clamp(0, n_freqs - 2)
    frac = (position - low).clamp(0, 1)
    matrix = torch.zeros(len(alphas), n_freqs, n_freqs, dtype=torch.float64, device=alphas.device)
    matrix.scatter_add_(2, low[..., None], (1 - frac)[..., None])
    matrix.scatter_add_(2, low[..., None] + 1, frac[..., None])
    return matrix.float()


# ---- the per-utterance pipeline -----------------------------------------------------------------





class Augmenter:
    """The augmentations of ``AugmentConfig`` for one utterance at a time: ``waveform`` (speed,
    then reverberation, then noise: the noise is not in the room) and ``vtlp_alpha`` (for
    ``LogMel``). Folders are listed once, here, so a bad one stops the run before any work."""

    def __init__(self, cfg: AugmentConfig, streams: str = ""):
        # ``streams`` prefixes the name of each draw's stream: a second augmenter of the same
        # utterances (the noisy student's, "pseudo/") draws apart from the first.
        self.cfg, self.streams = cfg, streams
        self.noise_files = (
            list_audio_files(cfg.noise_dir, "noise_dir") if cfg.noise_dir and cfg.noise_prob else []
        )
        self.rir_files = (
            list_audio_files(cfg.rir_dir, "rir_dir") if cfg.rir_dir and cfg.reverb_prob else []
        )

    def describe(self) -> str:
        """One line: the augmentations that are on."""
        cfg, parts = self.cfg, []
        if cfg.speed_perturb:
            parts.append("speed perturbation x" + "/".join(f"{f:g}" for f in SPEED_FACTORS))
        if cfg.reverb_prob:
            source = (
                f"{len(self.rir_files)} RIRs from {cfg.rir_dir}"
                if self.rir_files
                else "synthetic rooms"
            )
            parts.append(f"reverberation p={cfg.reverb_prob:g} ({source})")
        if cfg.noise_prob:
            source = (
                f"{len(self.noise_files)} files from {cfg.noise_dir}"
                if self.noise_files
                else "generated noise"
            )
            parts.append(
                f"noise p={cfg.noise_prob:g} at {cfg.noise_snr_db[0]:g}-{cfg.noise_snr_db[1]:g} dB"
                f" SNR ({source})"
            )
        if cfg.vtlp_prob:
            parts.append(f"VTLP p={cfg.vtlp_prob:g}, alpha {VTLP_RANGE[0]:g}-{VTLP_RANGE[1]:g}")
        if cfg.augment_ramp_epochs and (cfg.reverb_prob or cfg.noise_prob or cfg.vtlp_prob):
            parts.append(f"their probabilities ramped up over {cfg.augment_ramp_epochs} epochs")
        return "; ".join(parts) if parts else "none"

    def speed_factor(self, epoch: int, index: int) -> float:
        if not self.cfg.speed_perturb:
            return 1.0
        gen = utterance_generator(self.cfg.seed, epoch, index, self.streams + "speed")
        return SPEED_FACTORS[_randint(gen, len(SPEED_FACTORS))]

    def vtlp_alpha(self, epoch: int, index: int) -> Optional[float]:
        """The warp factor of this utterance, or None for no warp."""
        if not self.cfg.vtlp_prob:
            return None
        gen = utterance_generator(self.cfg.seed, epoch, index, self.streams + "vtlp")
        chance = _chance(gen, self.ramped(self.cfg.vtlp_prob, epoch))
        return _uniform(gen, *VTLP_RANGE) if chance else None

    def ramped(self, prob: float, epoch: int) -> float:
        """``prob`` in epoch ``epoch`` (from 0): with ``augment_ramp_epochs`` N it grows by p/N an
        epoch, to the full p from epoch N - 1 on, so the first epochs see mostly clean audio (a
        curriculum); without, p throughout."""
        return prob * ramp_done(epoch + 1, self.cfg.augment_ramp_epochs)

    def waveform(
        self, wav: torch.Tensor, epoch: int, index: int, min_encoder_frames: int = 0
    ) -> torch.Tensor:
        """``wav`` with this utterance's speed, reverberation and noise draws applied. A speed-up
        that would leave fewer than ``min_encoder_frames`` encoder frames (what its tokens need,
        ``manifest.ctc_frames_needed``; counted as ``frames.ctc_frames_of`` counts: CTC could not
        align it, and its loss would be zeroed) is not applied."""
        factor = self.speed_factor(epoch, index)
        if factor > 1 and ctc_frames_of_samples(int(len(wav) / factor)) < min_encoder_frames:
            factor = 1.0
        wav = speed_perturb(wav, factor)
        if self.cfg.reverb_prob:
            gen = utterance_generator(self.cfg.seed, epoch, index, self.streams + "reverb")
            if _chance(gen, self.ramped(self.cfg.reverb_prob, epoch)):
                wav = self._reverb(wav, gen)
        if self.cfg.noise_prob:
            gen = utterance_generator(self.cfg.seed, epoch, index, self.streams + "noise")
            if _chance(gen, self.ramped(self.cfg.noise_prob, epoch)):
                wav = self._noise(wav, gen)[0]
        return wav

    def _reverb(self, wav: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        if not self.rir_files:
            return reverberate(wav, synthetic_rir(gen))
        path = self.rir_files[_randint(gen, len(self.rir_files))]
        try:
            return reverberate(wav, _load_rir(path))
        except RuntimeError as e:  # a file that passed the header check but does not decode
            log.warning("%s; this utterance is not reverberated", e)
            return wav

    def _noise(self, wav: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, float]:
        """``wav`` with noise at a drawn SNR, and that SNR."""
        snr_db = _uniform(gen, *self.cfg.noise_snr_db)
        if not self.noise_files:
            return add_noise(wav, coloured_noise(len(wav), gen), snr_db), snr_db
        path = self.noise_files[_randint(gen, len(self.noise_files))]
        try:
            noise = _noise_excerpt(path, len(wav), gen)
        except RuntimeError as e:  # soundfile's LibsndfileError is one
            log.warning("noise file %s: %s; this utterance gets no noise", path, e)
            return wav, math.inf
        return add_noise(wav, noise, snr_db), snr_db


# ---- a corrupted copy of a manifest -------------------------------------------------------------
