"""Word and character error rates (jiwer) on normalized text."""
from __future__ import annotations

from typing import Sequence

import jiwer

from .tokenizer import normalize_text

__all__ = ["error_rates"]


def error_rates(references: Sequence[str], hypotheses: Sequence[str]) -> dict[str, float]:
    """Corpus-level ``{"wer": ..., "cer": ...}`` over normalized texts (empty references are left out)."""
    pairs = [(normalize_text(r), normalize_text(h)) for r, h in zip(references, hypotheses, strict=True)]
    pairs = [(r, h) for r, h in pairs if r]
    if not pairs:
        return {"wer": float("nan"), "cer": float("nan")}
    refs, hyps = zip(*pairs)
    return {"wer": jiwer.wer(list(refs), list(hyps)), "cer": jiwer.cer(list(refs), list(hyps))}
