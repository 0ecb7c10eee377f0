"""Tone "speech" the streaming and server tests learn in seconds: four sentences over six letters,
each letter a pitch."""
import math

import torch

from konkanivani.data.frames import SAMPLE_RATE

SENTENCES = ["abc de", "fed cab", "bad cafe", "ace bed fad"]
LETTERS = "abcdef"


def speech(text: str, seed: int = 0) -> torch.Tensor:
    """150 ms of a tone per letter (each letter its pitch), 100 ms between words, 300 ms of near
    silence around."""
    t = torch.arange(2400) / SAMPLE_RATE
    parts = [torch.zeros(4800)]
    for i, word in enumerate(text.split()):
        parts += [torch.zeros(1600)] * bool(i)
        parts += [
            0.3
            * torch.sin(2 * math.pi * (300 + 250 * LETTERS.index(ch)) * t)
            * torch.hann_window(2400)
            for ch in word
        ]
    wav = torch.cat([*parts, torch.zeros(4800)])
    return wav + 0.003 * torch.randn(len(wav), generator=torch.Generator().manual_seed(seed))
