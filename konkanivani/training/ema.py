"""An exponential moving average of the weights (``--ema_decay``), kept by torch's
``AveragedModel``.

After every optimizer step that updated the weights θ_t, ``ema_t = d_t * ema_{t-1} + (1 - d_t) *
θ_t``; the first update copies θ_1 (``AveragedModel`` counts its updates in ``n_averaged`` and
copies while it is 0). The decay warms up, ``d_t = min(D, t / (t + 9))`` (t-th update; the rule of
TensorFlow's ``ExponentialMovingAverage`` with ``num_updates``): with a constant D = 0.998 the
weights of step 1, nearly the random initialization, would still weigh 0.998^880 = 17% after the 880
steps of a 30-minute CPU run, and the average scored 100% CER at step 240 where the training
were far along. The CMVN statistics are buffers, averaged along with the weights (``use_buffers``):
they never change in training, so the average holds them as they are. Validation, best.pt and
decoding use the average; the raw weights go on training (and into every checkpoint as ``model``).
"""
from __future__ import annotations

from typing import Any

import torch
from torch.optim.swa_utils import AveragedModel

__all__ = ["make_ema", "ema_state", "load_ema_state", "warmed_up_decay"]


def warmed_up_decay(decay: float, update: int) -> float:
    """The decay of the ``update``-th update (1-based; the first copies): ``min(decay, t / (t +
    9))``."""
    return min(decay, update / (update + 9))


def _ema_multi_avg_fn(decay: float):
    """``AveragedModel``'s ``multi_avg_fn``: as torch's ``get_ema_multi_avg_fn``, with the decay
    warmed up by the number of updates averaged so far."""
    @torch.no_grad()
    def update(
        averaged: list[torch.Tensor], current: list[torch.Tensor], num_averaged: torch.Tensor
    ) -> None:
        d = warmed_up_decay(decay, int(num_averaged) + 1)
        if torch.is_floating_point(averaged[0]) or torch.is_complex(averaged[0]):
            torch._foreach_lerp_(averaged, current, 1 - d)
        else:  # foreach lerp takes floating point only
            for a, c in zip(averaged, current):
                a.copy_(a * d + c * (1 - d))

    return update


def make_ema(model: torch.nn.Module, decay: float) -> AveragedModel:
    """An average of ``model`` (the unwrapped module: not its DDP or compiled wrapper), on its
    device; it holds a copy of the weights until the first ``update_parameters(model)``."""
    ema = AveragedModel(model, multi_avg_fn=_ema_multi_avg_fn(decay), use_buffers=True)
    # The copy of a layer that --compile compiled (training.compile) holds the original layer's
    # compiled forward, bound to the original's weights: the average runs its own, eager.
    for module in ema.module.modules():
        module.__dict__.pop("forward", None)
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
