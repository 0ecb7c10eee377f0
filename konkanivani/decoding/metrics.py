"""Word and character error rates (jiwer) on normalized text: one path for validation and
evaluation."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import jiwer

from ..data.tokenizer import normalize_text

__all__ = ["ErrorCounts", "score", "error_rates"]


@dataclass
class ErrorCounts:
    """Edit operations against a reference of ``length`` units (words or characters)."""

    length: int = 0
    substitutions: int = 0
    deletions: int = 0
    insertions: int = 0

    @property
    def errors(self) -> int:
        return self.substitutions + self.deletions + self.insertions

    @property
    def rate(self) -> float:
        return self.errors / self.length if self.length else float("nan")

    def __iadd__(self, other: ErrorCounts) -> ErrorCounts:
        self.length += other.length
        self.substitutions += other.substitutions
        self.deletions += other.deletions
        self.insertions += other.insertions
        return self


def _counts(output) -> ErrorCounts:
    return ErrorCounts(output.hits + output.substitutions + output.deletions, output.substitutions,
                       output.deletions, output.insertions)


def score(reference: str, hypothesis: str) -> tuple[ErrorCounts, ErrorCounts]:
    """Word and character error counts of one normalized pair (the reference must not be empty)."""
    ref, hyp = normalize_text(reference), normalize_text(hypothesis)
    return _counts(jiwer.process_words(ref, hyp)), _counts(jiwer.process_characters(ref, hyp))


def error_rates(references: Sequence[str], hypotheses: Sequence[str]) -> dict[str, float]:
    """Corpus-level ``{"wer": ..., "cer": ...}``: the errors of every pair over the length of every
    reference, on normalized texts (empty references are left out)."""
    words, chars = ErrorCounts(), ErrorCounts()
    for reference, hypothesis in zip(references, hypotheses, strict=True):
        if normalize_text(reference):
            w, c = score(reference, hypothesis)
            words += w
            chars += c
    return {"wer": words.rate, "cer": chars.rate}
