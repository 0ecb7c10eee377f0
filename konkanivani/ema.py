"""An exponential moving average of the weights (``--ema_decay``), kept by torch's ``AveragedModel``.

After every optimizer step that updated the weights θ_t, ``ema_t = D * ema_{t-1} + (1 - D) * θ_t``;
the first update copies θ_1 (``AveragedModel`` counts its updates in ``n_averaged`` and copies
while it is 0). The CMVN statistics are buffers, averaged along with the weights (``use_buffers``):
they never change in training, so the average holds them as they are. Validation, best.pt and
decoding use the average; the raw weights go on training (and into every checkpoint as ``model``).
"""
from __future__ import annotations

from typing import Any

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

__all__ = ["make_ema", "ema_state", "load_ema_state"]


def make_ema(model: torch.nn.Module, decay: float) -> AveragedModel:
    """An average of ``model`` (the unwrapped module: not its DDP or compiled wrapper), on its
    device; it holds a copy of the weights until the first ``update_parameters(model)``."""
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
    ema.requires_grad_(False)  # never trained: no gradients kept for it
    return ema


def ema_state(ema: AveragedModel) -> tuple[dict[str, Any], int]:
    """What a checkpoint keeps of it: the averaged weights, with the model's own keys (so any
    loader of an ``ASRModel`` reads them), and the number of updates averaged."""
    return ema.module.state_dict(), int(ema.n_averaged)


def load_ema_state(ema: AveragedModel, weights: dict[str, Any], updates: int) -> None:
    """The average as ``ema_state`` saved it: a resumed run goes on averaging as an unbroken one."""
    ema.module.load_state_dict(weights)
    ema.n_averaged.fill_(updates)
