"""Time in samples, feature frames and encoder frames: the arithmetic every module shares.

Audio is 16 kHz; ``LogMel`` makes one feature frame every 160 samples (10 ms, 100 a second); the
encoder's two stride-2, kernel-3 convolutions keep about one frame in four.
"""
from __future__ import annotations

from typing import TypeVar

import torch

__all__ = [
    "SAMPLE_RATE",
    "HOP_LENGTH",
    "FRAMES_PER_SECOND",
    "frames_of",
    "subsampled_lengths",
    "budget_frames",
]

SAMPLE_RATE = 16000
HOP_LENGTH = 160
FRAMES_PER_SECOND = SAMPLE_RATE // HOP_LENGTH  # 100

Lengths = TypeVar("Lengths", int, torch.Tensor)


def frames_of_samples(samples: int) -> int:
    """Feature frames ``LogMel`` makes of ``samples`` samples: 1 + samples // 160."""
    return 1 + samples // HOP_LENGTH


def frames_of(seconds: float) -> int:
    """Feature frames of ``seconds`` of audio, as ``LogMel`` makes them (``frames_of_samples``).

    >>> frames_of(1.0), frames_of(0.0)
    (101, 1)
    """
    return frames_of_samples(int(seconds * SAMPLE_RATE))


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
