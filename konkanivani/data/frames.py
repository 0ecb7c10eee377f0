"""Time in samples, feature frames and encoder frames: the arithmetic every module shares.

Audio is 16 kHz; each front-end makes one feature frame every 160 samples (10 ms, 100 a second);
the encoder's two stride-2, kernel-3 convolutions keep about one frame in four.

The two front-ends count an utterance's frames one apart at most: ``LogMel`` makes
``1 + samples // 160`` (``frames_of_samples``), ``KaldiFbank`` ``(samples + 80) // 160``
(``kaldi_frames_of_samples``), one fewer for half of all lengths. Each count is used as the bound it
is, so that neither depends on the model's front-end:

- batching (frame budgets, length buckets, padding, the memory estimate's longest utterance) counts
  the most frames, ``frames_of``: a batch never holds more than its budget says;
- the CTC check (``ctc_frames_of``) counts the fewest: a text it lets through can be aligned
  whichever front-end the model has.
"""
from __future__ import annotations

from typing import TypeVar

import torch

__all__ = [
    "SAMPLE_RATE",
    "HOP_LENGTH",
    "FRAMES_PER_SECOND",
    "frames_of",
    "frames_of_samples",
    "kaldi_frames_of_samples",
    "ctc_frames_of",
    "ctc_frames_of_samples",
    "subsampled_lengths",
    "budget_frames",
    "padded_frames",
    "padded_samples",
    "rounded_up",
]

SAMPLE_RATE = 16000
HOP_LENGTH = 160
FRAMES_PER_SECOND = SAMPLE_RATE // HOP_LENGTH  # 100

Lengths = TypeVar("Lengths", int, torch.Tensor)


def frames_of_samples(samples: int) -> int:
    """Feature frames ``LogMel`` makes of ``samples`` samples: 1 + samples // 160, the most of
    either front-end."""
    return 1 + samples // HOP_LENGTH


def kaldi_frames_of_samples(samples: int) -> int:
    """Feature frames ``KaldiFbank`` makes of ``samples`` samples (Kaldi's count without
    ``snip_edges``): (samples + 80) // 160, the fewest of either front-end."""
    return (samples + HOP_LENGTH // 2) // HOP_LENGTH


def frames_of(seconds: float) -> int:
    """Feature frames of ``seconds`` of audio for batching: the most either front-end makes
    (``frames_of_samples``).

    >>> frames_of(1.0), frames_of(0.0)
    (101, 1)
    """
    return frames_of_samples(int(seconds * SAMPLE_RATE))


def ctc_frames_of(seconds: float) -> int:
    """Encoder frames CTC can align a text to in ``seconds`` of audio: those of the fewest feature
    frames either front-end makes (``kaldi_frames_of_samples``).

    >>> ctc_frames_of(1.0), subsampled_lengths(frames_of(1.0)), ctc_frames_of(1.005)
    (24, 24, 24)
    >>> ctc_frames_of(0.9), subsampled_lengths(frames_of(0.9))
    (21, 22)
    """
    return ctc_frames_of_samples(round(seconds * SAMPLE_RATE))


def ctc_frames_of_samples(samples: int) -> int:
    """``ctc_frames_of`` for ``samples`` samples: the encoder frames of
    ``kaldi_frames_of_samples``."""
    return subsampled_lengths(kaldi_frames_of_samples(samples))


def subsampled_lengths(frames: Lengths) -> Lengths:
    """Encoder frames of ``frames`` feature frames (an int or a tensor of them) after the two
    stride-2, kernel-3 convolutions (4x subsampling).

    >>> subsampled_lengths(torch.tensor([7, 8, 100])), subsampled_lengths(101)
    (tensor([ 1,  1, 24]), 24)
    """
    return ((frames - 1) // 2 - 1) // 2


def budget_frames(max_batch_frames: int, max_batch_seconds: float) -> int:
    """The dynamic-batch budget in padded feature frames: ``--max_batch_frames``, or
    ``--max_batch_seconds`` at 100 frames a second; 0 when neither is given."""
    return max_batch_frames or round(max_batch_seconds * FRAMES_PER_SECOND)


def rounded_up(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple`` (0: as it is)."""
    return -(-length // multiple) * multiple if multiple else length


def padded_frames(frames: int, pad_to_frames: int) -> int:
    """The feature frames (``1 + samples // 160``) of a batch whose longest utterance has
    ``frames``, padded by ``--pad_to_frames`` N: ``1 + (frames - 1)`` rounded up to a multiple of N
    (0: not padded). Collating (``padded_samples``) and frame budgets both count by this.

    >>> padded_frames(101, 50), padded_frames(151, 50), padded_frames(152, 50), padded_frames(7, 0)
    (101, 151, 201, 7)
    """
    return 1 + rounded_up(frames - 1, pad_to_frames) if pad_to_frames else frames


def padded_samples(samples: int, pad_to_frames: int) -> int:
    """The samples a batch whose longest utterance has ``samples`` is padded to, the fewest (and at
    least ``samples``) that make ``padded_frames`` of its frames.

    >>> padded_samples(24210, 50), padded_samples(24050, 50), padded_samples(22420, 50)
    (32000, 24050, 24000)
    """
    frames = padded_frames(frames_of_samples(samples), pad_to_frames)
    return max(samples, (frames - 1) * HOP_LENGTH)
