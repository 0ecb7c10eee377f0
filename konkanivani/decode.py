"""Decoding from model outputs. Greedy CTC for validation."""
from __future__ import annotations

import torch

from .tokenizer import BLANK_ID

__all__ = ["ctc_greedy"]


@torch.inference_mode()
def ctc_greedy(log_probs: torch.Tensor, lengths: torch.Tensor) -> list[list[int]]:
    """Best path: argmax per frame, merge repeats, drop blanks.

    Args:
        log_probs: ``(B, T', V)``; lengths: ``(B,)``.
    Returns:
        B lists of token ids.
    """
    best = log_probs.argmax(dim=-1).cpu()  # (B, T')
    hyps = []
    for path, length in zip(best.tolist(), lengths.tolist()):
        out, prev = [], BLANK_ID
        for tok in path[:length]:
            if tok != prev and tok != BLANK_ID:
                out.append(tok)
            prev = tok
        hyps.append(out)
    return hyps
