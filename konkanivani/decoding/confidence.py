"""How far to trust a teacher's text of untranscribed audio (``konkanivani-pseudolabel``).

Everything here is what decoding already gives, so scoring an utterance costs nothing beyond
decoding it:

- **word probabilities**: each word's CTC posterior on its aligned frames (``alignment``); their
  mean, and the least of them (a label with one doubtful word is recorded as such);
- **CTC/attention agreement**: ``1 - CER`` of the greedy CTC text against the chosen method's text
  (0 at worst), from the same forward pass (``Recognizer.decode_with_greedy``). Where the CTC head
  alone and the joint search disagree, the decoder has guessed; where they agree, both heads heard
  the same thing;
- **length ratio**: characters per second of audio. A label far too short for its audio (the
  model gave up on noise or music) or far too long (a decoder loop) is dropped whatever its score.

An utterance's confidence is the mean word probability times the agreement, in [0, 1]. The
threshold is best chosen on transcribed speech (``choose_threshold``): the lowest confidence whose
kept utterances' CER against their true text is under a target, so the most audio is kept at a
known label quality.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..data.tokenizer import normalize_text
from .alignment import Word
from .metrics import ErrorCounts, score

__all__ = ["MAX_CHARS_PER_SECOND", "MIN_CHARS_PER_SECOND", "REPORT_THRESHOLDS", "Confidence",
           "Scored", "choose_threshold", "confidence_of", "kept_cer"]

# Bounds of a plausible label's characters per second of audio (normalized text, spaces included).
# Read Konkani runs at about 10-15; the bounds are wide, to drop only what is clearly wrong.
MIN_CHARS_PER_SECOND = 2.0
MAX_CHARS_PER_SECOND = 40.0
# The thresholds the report counts kept utterances at (the chosen one is added).
REPORT_THRESHOLDS = (0.0, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


@dataclass(frozen=True)
class Confidence:
    """The scores of one label (see the module)."""

    word_prob_mean: float
    word_prob_min: float
    agreement: float
    chars_per_second: float

    @property
    def value(self) -> float:
        return round(self.word_prob_mean * self.agreement, 4)


def confidence_of(text: str, words: Sequence[Word], greedy_text: str, duration: float
                  ) -> Confidence:
    """The scores of the label ``text`` of ``duration`` seconds of audio, with its aligned
    ``words`` and the greedy CTC text of the same pass. A text whose words could not be aligned
    (an attention hypothesis longer than CTC allows) has word probability 0."""
    probabilities = [w.probability for w in words if w.probability is not None]
    if not normalize_text(text):
        agreement = 1.0 if not normalize_text(greedy_text) else 0.0
        mean = low = 0.0
    else:
        _, chars = score(text, greedy_text)
        agreement = max(0.0, 1.0 - chars.rate)
        mean = sum(probabilities) / len(probabilities) if probabilities else 0.0
        low = min(probabilities) if probabilities else 0.0
    per_second = len(normalize_text(text)) / duration if duration > 0 else 0.0
    return Confidence(round(mean, 4), round(low, 4), round(agreement, 4), round(per_second, 2))


@dataclass
class Scored:
    """A labelled utterance of a transcribed set: its confidence and its label's character errors
    against the true text."""

    confidence: float
    chars: ErrorCounts


def kept_cer(scored: Sequence[Scored], threshold: float) -> tuple[int, float]:
    """How many of ``scored`` a ``threshold`` keeps (confidence >= it) and their labels' CER
    (NaN when none is kept)."""
    total, kept = ErrorCounts(), 0
    for s in scored:
        if s.confidence >= threshold:
            kept += 1
            total += s.chars
    return kept, total.rate


def choose_threshold(scored: Sequence[Scored], target_cer: float) -> float | None:
    """The lowest threshold whose kept utterances' CER is at most ``target_cer`` (a fraction): the
    most audio at that label quality. The candidates are the confidences themselves; None when no
    threshold reaches the target."""
    for threshold in sorted({s.confidence for s in scored}):
        kept, cer = kept_cer(scored, threshold)
        if kept and cer <= target_cer:
            return threshold
    return None
