"""The optimizer and the learning rate's schedule (a pure function of the step and epoch:
``scheduled_lr``, Noam's ``lr_factor`` or Zipformer's Eden; the loss weights' ramps are the
objective's, ``objective.Objective.at``). The optimizer is standard AdamW; 8-bit AdamW from
bitsandbytes (its two moments stored in 8 bits, 2 bytes per parameter instead of 8), with a fallback
to standard AdamW when bitsandbytes is missing or cannot run on the device; or ScaledAdam
(``scaled_adam``)."""
from __future__ import annotations

import logging
import math
from typing import Iterable

import torch

from ..config import OPTIMIZERS, TrainConfig
from .scaled_adam import ScaledAdam

__all__ = ["canonical_optimizer", "build_optimizer", "adamw", "scheduled_lr", "eden_factor",
           "lr_factor"]

log = logging.getLogger("konkanivani")



def canonical_optimizer(name: str) -> str:
    try:
        return OPTIMIZERS[name.lower()]
    except KeyError:
        raise ValueError(
            f"--optimizer {name!r}: choose adamw, adamw_8bit (also spelled adamw8bit) or "
            "scaled_adam"
        ) from None


def _adamw_8bit(
    params: list[torch.nn.Parameter], device: torch.device, **kwargs
) -> torch.optim.Optimizer:
    """bitsandbytes' AdamW8bit, after one trial step on a scratch tensor of the device (a build
    without kernels for the device fails there rather than at the first real step)."""
    import bitsandbytes as bnb

    # large enough to take the 8-bit path
    probe = torch.nn.Parameter(torch.zeros(4096, device=device))
    probe.grad = torch.ones_like(probe)
    bnb.optim.AdamW8bit([probe], lr=1e-3).step()
    return bnb.optim.AdamW8bit(params, **kwargs)


def build_optimizer(
    name: str,
    params: Iterable[torch.nn.Parameter],
    device: torch.device,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.98),
) -> tuple[torch.optim.Optimizer, str]:
    """The optimizer ``name`` asks for, or standard AdamW with a warning saying why not.
    Returns it and the canonical name of the optimizer that actually runs. ScaledAdam has no weight
    decay: it keeps each tensor's scale within bounds instead."""
    name = canonical_optimizer(name)
    params = list(params)
    if name == "scaled_adam":
        return ScaledAdam(params, lr=lr, betas=betas), name
    if name == "adamw_8bit":
        try:
            return _adamw_8bit(params, device, lr=lr, betas=betas, weight_decay=weight_decay), name
        except ImportError:
            reason = "bitsandbytes is not installed (pip install 'konkanivani[8bit]')"
        except Exception as e:  # a build without support for this device or platform
            reason = f"bitsandbytes cannot run on {device.type} here ({type(e).__name__}: {e})"
        log.warning(
            "--optimizer adamw_8bit: %s; using standard AdamW (4x more optimizer memory)", reason
        )
    return adamw(params, lr=lr, betas=betas, weight_decay=weight_decay), "adamw"


def adamw(params: list[torch.nn.Parameter], **kwargs) -> torch.optim.Optimizer:
    """torch's AdamW with its fused kernel (one pass over all parameters instead of a dozen small
    ops per tensor; CPU and CUDA, torch 2.4 and later); its ``foreach`` form where the fused one
    cannot take these parameters (sharded DTensors under FSDP, an older torch)."""
    plain = all(type(p) is torch.nn.Parameter and p.device.type in ("cpu", "cuda") for p in params)
    if plain:
        try:
            return torch.optim.AdamW(params, fused=True, **kwargs)
        except (RuntimeError, TypeError, ValueError):
            pass
    return torch.optim.AdamW(params, foreach=True, **kwargs)


def scheduled_lr(cfg: TrainConfig, step: int, epoch: int) -> float:
    """The LR of ``cfg`` for the update after ``step`` optimizer steps in (0-based)
    ``epoch``: a pure function of the two, so resuming needs only the step and epoch counts."""
    if cfg.lr_schedule == "eden":
        return cfg.lr * eden_factor(step, epoch, cfg.warmup_steps, cfg.eden_steps,
                                    cfg.eden_epochs)
    return cfg.lr * lr_factor(step, cfg.warmup_steps)


def eden_factor(step: int, epoch: int, warmup_steps: int, decay_steps: int,
                decay_epochs: float) -> float:
    """Multiplier of the peak LR in Zipformer's Eden schedule: from 0.5 to 1 over the warm-up,
    times a factor falling as step^-1/2 after ``decay_steps`` and one falling as epoch^-1/2 after
    ``decay_epochs`` (both near 1 before them)."""
    warm = 1.0 if step >= warmup_steps else 0.5 + 0.5 * step / warmup_steps
    return (warm * (1 + (step / decay_steps) ** 2) ** -0.25
            * (1 + (epoch / decay_epochs) ** 2) ** -0.25)


def lr_factor(step: int, warmup_steps: int) -> float:
    """Multiplier of the peak LR after ``step`` optimizer steps: linear warm-up, then 1/sqrt decay.

    A pure function of the step, so resuming needs only the step count.
    """
    step += 1
    if warmup_steps <= 0:
        return 1.0
    return min(step / warmup_steps, math.sqrt(warmup_steps / step))


