"""Tone "speech" the streaming and server tests learn in seconds: four sentences over six letters,
each letter a pitch."""
import math
import random

import torch

from konkanivani.data.frames import SAMPLE_RATE

SENTENCES = ["abc de", "fed cab", "bad cafe", "ace bed fad"]
LETTERS = "abcdef"


def _spoken(words: list[list[torch.Tensor]], gap: int, noise: float, seed: int) -> torch.Tensor:
    """The letters' sounds of each word one after the other, ``gap`` samples of silence between
    words and 300 ms around, plus seeded noise of std ``noise``."""
    parts = [torch.zeros(4800)]
    for i, letters in enumerate(words):
        parts += [torch.zeros(gap)] * bool(i)
        parts += letters
    wav = torch.cat([*parts, torch.zeros(4800)])
    return wav + noise * torch.randn(len(wav), generator=torch.Generator().manual_seed(seed))


def speech(text: str, seed: int = 0) -> torch.Tensor:
    """150 ms of a tone per letter (each letter its pitch), 100 ms between words, 300 ms of near
    silence around."""
    t = torch.arange(2400) / SAMPLE_RATE
    words = [[0.3 * torch.sin(2 * math.pi * (300 + 250 * LETTERS.index(ch)) * t)
              * torch.hann_window(2400) for ch in word] for word in text.split()]
    return _spoken(words, 1600, 0.003, seed)


def mixed_speech(e_share: float) -> torch.Tensor:
    """ "bad cafe", the first "a" a mix of the tones of "a" (``1 - e_share``) and "e": a word a
    model of these tones hears as "bad" or "bed" by a little (the hotword tests)."""
    t = torch.arange(2400) / SAMPLE_RATE

    def tone(letter):
        return torch.sin(2 * math.pi * (300 + 250 * LETTERS.index(letter)) * t)

    def sound(i, j, letter):
        wave = (1 - e_share) * tone("a") + e_share * tone("e") if (i, j) == (0, 1) else (
            tone(letter))
        return 0.3 * wave * torch.hann_window(2400)

    words = [[sound(i, j, letter) for j, letter in enumerate(word)]
             for i, word in enumerate(["bad", "cafe"])]
    return _spoken(words, 1600, 0.003, 5)


def voiced_speech(text: str, seed: int, pitch_spread: float) -> torch.Tensor:
    """Tone speech read by a "speaker": a seeded base pitch f0 (330 Hz times a factor within
    ``1 +- pitch_spread``) and tempo (0.8-1.25). Each letter sounds f0 together with the letter's
    own interval above it (f0 times 1.3 + 0.25 k for the k-th letter), so a letter is an interval,
    not a pitch: a model learns it across speakers only from many of them, as with real voices."""
    rng = random.Random(seed)
    f0, tempo = 330 * rng.uniform(1 - pitch_spread, 1 + pitch_spread), rng.uniform(0.8, 1.25)
    n = int(2400 * tempo)
    t = torch.arange(n) / SAMPLE_RATE

    def sound(letter):
        interval = 1.3 + 0.25 * LETTERS.index(letter)
        wave = torch.sin(2 * math.pi * f0 * t) + torch.sin(2 * math.pi * f0 * interval * t)
        return 0.3 * wave * torch.hann_window(n)

    words = [[sound(ch) for ch in word] for word in text.split()]
    return _spoken(words, int(4000 * tempo), 0.01, seed)
