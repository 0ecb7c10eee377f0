"""Masked prediction of random-projection codes (BEST-RQ, Chiu et al., 2022): what self-supervised
pretraining of the encoder on audio without transcripts predicts, and where.

- ``RandomProjectionQuantizer``: each encoder frame's target, the code of the normalized features it
  stands for (feature frames ``4t .. 4t + 3`` stacked: the front-end's stride), through a frozen
  random projection to the nearest, by cosine, of a frozen random codebook. Neither is trained; both
  are drawn from a seed and kept as buffers, so a checkpoint holds them.
- ``span_mask``: the feature frames the encoder sees masked: each frame of an utterance starts a
  span of ``span`` frames with probability ``prob``; ``mask_features`` puts noise in them.
- ``masked_frames``: the encoder frames whose stacked features hold a masked one, where the loss is
  taken; ``masked_prediction_loss``: the cross-entropy of a head over the encoder's states there,
  summed over them.

The codes of unmasked features are the targets: the encoder must infer from the context what the
masked stretch held. A model that learns nothing scores ``log(codebook_size)`` a frame.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RandomProjectionQuantizer", "mask_features", "masked_frames",
           "masked_prediction_loss", "span_mask"]

STACK = 4  # feature frames per encoder frame: Conv2dSubsampling.STRIDE


class RandomProjectionQuantizer(nn.Module):
    """Stacked features ``(B, T, n_mels)`` -> codes ``(B, T')``: ``STACK`` frames a code, through a
    Xavier-uniform ``(STACK * n_mels, code_dim)`` projection, to the index of the nearest of
    ``codebook_size`` unit vectors, all drawn from ``seed``.

    Examples:
        >>> q = RandomProjectionQuantizer(n_mels=8, codebook_size=16, seed=1)
        >>> codes = q(torch.randn(2, 40, 8), frames=9)
        >>> codes.shape, bool((codes >= 0).all() and (codes < 16).all())
        (torch.Size([2, 9]), True)
    """

    def __init__(self, n_mels: int, codebook_size: int = 1024, code_dim: int = 16, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        fan_in = STACK * n_mels
        bound = math.sqrt(6.0 / (fan_in + code_dim))
        projection = torch.empty(fan_in, code_dim).uniform_(-bound, bound, generator=generator)
        codebook = F.normalize(torch.randn(codebook_size, code_dim, generator=generator), dim=-1)
        self.register_buffer("projection", projection)
        self.register_buffer("codebook", codebook)

    @property
    def codebook_size(self) -> int:
        return self.codebook.shape[0]

    @torch.no_grad()
    def forward(self, feats: torch.Tensor, frames: int) -> torch.Tensor:
        """The codes of the first ``frames`` encoder frames of normalized features ``feats``
        (padded with zeros where they are shorter than ``frames * STACK``)."""
        batch, length, bins = feats.shape
        need = frames * STACK
        x = feats[:, :need] if length >= need else F.pad(feats, (0, 0, 0, need - length))
        z = x.float().reshape(batch, frames, STACK * bins) @ self.projection
        return (F.normalize(z, dim=-1) @ self.codebook.T).argmax(-1)


def span_mask(lengths: torch.Tensor, frames: int, prob: float, span: int,
              generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """``(B, frames)`` True where a feature frame is masked: each frame within its utterance's
    length starts a span of ``span`` frames with probability ``prob`` (about
    ``1 - (1 - prob) ** span`` of the frames masked, spans overlapping)."""
    valid = torch.arange(frames, device=lengths.device)[None] < lengths[:, None]
    draws = torch.rand(lengths.shape[0], frames, generator=generator).to(lengths.device)
    starts = ((draws < prob) & valid).int().cumsum(1)
    # frame t is masked when a span starts in t - span + 1 .. t
    before = F.pad(starts, (span, 0))[:, :frames]
    return (starts - before > 0) & valid


def mask_features(feats: torch.Tensor, mask: torch.Tensor, noise_std: float = 0.1,
                  generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """``feats`` ``(B, T, F)`` with the frames ``mask`` marks replaced by noise N(0, noise_std)."""
    noise = torch.randn(feats.shape, generator=generator).to(feats.device, feats.dtype)
    return torch.where(mask[..., None], noise * noise_std, feats)


def masked_frames(mask: torch.Tensor, frames: int) -> torch.Tensor:
    """``(B, frames)``: the encoder frames ``t`` whose stacked feature frames ``4t .. 4t + 3`` hold
    a frame ``mask`` ``(B, T)`` marks."""
    need = frames * STACK
    m = mask[:, :need] if mask.shape[1] >= need else F.pad(mask, (0, need - mask.shape[1]))
    return m.reshape(mask.shape[0], frames, STACK).any(-1)


def masked_prediction_loss(states: torch.Tensor, lengths: torch.Tensor, codes: torch.Tensor,
                           masked: torch.Tensor, head: nn.Module
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The cross-entropy of ``head`` over the encoder ``states`` ``(B, T', D)`` against ``codes``
    ``(B, T')``, summed over the frames ``masked`` marks within ``lengths``; and their count (a
    0-dim tensor on the states' device: reading it is the caller's choice)."""
    valid = masked & (torch.arange(states.shape[1], device=states.device)[None]
                      < lengths[:, None])
    logits = head(states[valid]).float()
    return F.cross_entropy(logits, codes[valid], reduction="sum"), valid.sum()
