"""Masks from lengths, as pure functions. The polarity is in the name: ``pad_mask`` is True at
padding, ``causal_mask`` and ``chunk_mask`` are True where attention is allowed.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["pad_mask", "causal_mask", "chunk_mask"]


def pad_mask(lengths: torch.Tensor, max_len: Optional[int] = None) -> torch.Tensor:
    """``(B,)`` lengths -> ``(B, T)`` bool, True at padding.

    >>> pad_mask(torch.tensor([3, 1]), 4)
    tensor([[False, False, False,  True],
            [False,  True,  True,  True]])
    """
    max_len = int(lengths.max()) if max_len is None else max_len
    steps = torch.arange(max_len, device=lengths.device)
    return steps.unsqueeze(0) >= lengths.unsqueeze(1)  # (B, T)


def causal_mask(size: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """``(U, U)`` bool, True where position i may attend to position j (j <= i).

    >>> causal_mask(3)
    tensor([[ True, False, False],
            [ True,  True, False],
            [ True,  True,  True]])
    """
    return torch.ones(size, size, dtype=torch.bool, device=device).tril()


def chunk_mask(
    size: int, chunk: int, left_chunks: int = -1, device: Optional[torch.device] = None
) -> torch.Tensor:
    """``(T, T)`` bool, True where frame i may attend to frame j: the frames are cut into chunks of
    ``chunk`` (the last one may be shorter), and i sees every frame of its own chunk and of the
    ``left_chunks`` chunks before it (all of them when ``left_chunks`` < 0), none after it.

    >>> chunk_mask(5, 2)
    tensor([[ True,  True, False, False, False],
            [ True,  True, False, False, False],
            [ True,  True,  True,  True, False],
            [ True,  True,  True,  True, False],
            [ True,  True,  True,  True,  True]])
    >>> chunk_mask(6, 2, left_chunks=1)
    tensor([[ True,  True, False, False, False, False],
            [ True,  True, False, False, False, False],
            [ True,  True,  True,  True, False, False],
            [ True,  True,  True,  True, False, False],
            [False, False,  True,  True,  True,  True],
            [False, False,  True,  True,  True,  True]])
    """
    index = torch.arange(size, device=device) // chunk  # each frame's chunk
    behind = index.unsqueeze(1) - index.unsqueeze(0)  # (T, T): i's chunk minus j's chunk
    allowed = behind >= 0
    return allowed if left_chunks < 0 else allowed & (behind <= left_chunks)
