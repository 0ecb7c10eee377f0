"""Masks from lengths, as pure functions. The polarity is in the name: ``pad_mask`` is True at
padding, ``valid_mask`` is True at real frames, ``causal_mask`` is True where attention is allowed.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["pad_mask", "valid_mask", "causal_mask"]


def pad_mask(lengths: torch.Tensor, max_len: Optional[int] = None) -> torch.Tensor:
    """``(B,)`` lengths -> ``(B, T)`` bool, True at padding.

    >>> pad_mask(torch.tensor([3, 1]), 4)
    tensor([[False, False, False,  True],
            [False,  True,  True,  True]])
    """
    max_len = int(lengths.max()) if max_len is None else max_len
    steps = torch.arange(max_len, device=lengths.device)
    return steps.unsqueeze(0) >= lengths.unsqueeze(1)  # (B, T)


def valid_mask(lengths: torch.Tensor, max_len: Optional[int] = None) -> torch.Tensor:
    """``(B,)`` lengths -> ``(B, T)`` bool, True at real frames."""
    return ~pad_mask(lengths, max_len)


def causal_mask(size: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """``(U, U)`` bool, True where position i may attend to position j (j <= i).

    >>> causal_mask(3)
    tensor([[ True, False, False],
            [ True,  True, False],
            [ True,  True,  True]])
    """
    return torch.ones(size, size, dtype=torch.bool, device=device).tril()

