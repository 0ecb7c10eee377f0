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


def mixed_speech(e_share: float) -> torch.Tensor:
    """ "bad cafe", the first "a" a mix of the tones of "a" (``1 - e_share``) and "e": a word a
    model of these tones hears as "bad" or "bed" by a little (the hotword tests)."""
    t = torch.arange(2400) / SAMPLE_RATE

    def tone(letter):
        return torch.sin(2 * math.pi * (300 + 250 * LETTERS.index(letter)) * t)

    parts = [torch.zeros(4800)]
    for i, word in enumerate(["bad", "cafe"]):
        parts += [torch.zeros(1600)] * bool(i)
        for j, letter in enumerate(word):
            wave = (1 - e_share) * tone("a") + e_share * tone("e") if (i, j) == (0, 1) else (
                tone(letter))
            parts.append(0.3 * wave * torch.hann_window(2400))
    wav = torch.cat([*parts, torch.zeros(4800)])
    return wav + 0.003 * torch.randn(len(wav), generator=torch.Generator().manual_seed(5))
