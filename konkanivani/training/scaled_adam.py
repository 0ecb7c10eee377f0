"""ScaledAdam, the optimizer Zipformer is trained with (Yao et al., 2023), written for this package:
Adam whose step on each tensor is proportional to that tensor's own scale (the root mean square of
its entries), and which learns each tensor's scale as a separate quantity.

- A tensor of more than one entry moves by ``lr * rms(p)`` times Adam's normalized gradient, so the
  same LR changes every weight matrix by the same *relative* amount whatever its size; its RMS is
  refreshed every ``size_update_period`` steps and kept at ``param_min_rms`` or more in the step.
- Its scale is learned as if ``p = p' * exp(s)``: the gradient of ``s`` is ``sum(p * grad)``,
  summed over ``size_update_period`` steps and applied with its own Adam-like normalization at
  ``lr * scalar_lr_scale``; a tensor whose RMS is above ``param_max_rms`` is shrunk, one below
  ``param_min_rms`` keeps its scale. There is no weight decay (the scale takes its place).
- A one-entry tensor takes plain Adam steps at ``lr * scalar_lr_scale``, within ``+-scalar_max``.
- Momentum (``beta1``) is on the whole update; no first-moment bias correction (slower first steps).

Its LRs are about ten times AdamW's (Zipformer: 0.045 with the Eden schedule). Every state is a
tensor or an int, so ``state_dict`` / ``load_state_dict`` resume it exactly.
"""
from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["ScaledAdam"]


class ScaledAdam(torch.optim.Optimizer):
    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 0.045,
                 betas: tuple[float, float] = (0.9, 0.98), scalar_lr_scale: float = 0.1,
                 eps: float = 1e-8, param_min_rms: float = 1e-5, param_max_rms: float = 3.0,
                 scalar_max: float = 10.0, size_update_period: int = 4):
        if lr <= 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1 or size_update_period < 1:
            raise ValueError(f"ScaledAdam: bad settings lr={lr}, betas={betas}, "
                             f"size_update_period={size_update_period}")
        super().__init__(params, dict(lr=lr, betas=betas, scalar_lr_scale=scalar_lr_scale, eps=eps,
                                      param_min_rms=param_min_rms, param_max_rms=param_max_rms,
                                      scalar_max=scalar_max, size_update_period=size_update_period))

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("ScaledAdam does not take sparse gradients")
                self._step_one(group, p, p.grad.float())
        return loss

    def _state(self, group: dict, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["delta"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            if p.numel() > 1:
                state["param_rms"] = p.detach().float().pow(2).mean().sqrt()
                state["scale_grads"] = p.new_zeros(group["size_update_period"],
                                                   dtype=torch.float32)
                state["scale_exp_avg_sq"] = p.new_zeros((), dtype=torch.float32)
        return state

    def _step_one(self, group: dict, p: torch.Tensor, grad: torch.Tensor) -> None:
        state = self._state(group, p)
        step, beta1 = state["step"], group["betas"][0]
        delta = state["delta"]
        delta.mul_(beta1)
        if p.numel() > 1:
            period = group["size_update_period"]
            state["scale_grads"][step % period] = (p.float() * grad).sum()
            if step % period == period - 1:
                state["param_rms"].copy_(p.float().pow(2).mean().sqrt())
                if step > 0:
                    self._size_update(group, p, state)
            self._tensor_step(group, grad, state)
        else:
            self._scalar_step(group, p, grad, state)
        p.add_(delta.to(p.dtype))
        state["step"] = step + 1

    @staticmethod
    def _size_update(group: dict, p: torch.Tensor, state: dict) -> None:
        """Learn the tensor's scale from the last ``size_update_period`` gradients of its log."""
        beta1, beta2 = group["betas"]
        scale_grads = state["scale_grads"]
        period = scale_grads.shape[0]
        beta2_period = beta2 ** period  # one update every `period` steps decays that much faster
        avg_sq = state["scale_exp_avg_sq"]
        avg_sq.mul_(beta2_period).add_(scale_grads.pow(2).mean(), alpha=1 - beta2_period)
        updates = (state["step"] + 1) // period
        size_lr = group["lr"] * group["scalar_lr_scale"]
        scale_step = (-size_lr * (1 - beta2_period ** updates) ** 0.5 * scale_grads.sum()
                      / (avg_sq.sqrt() + group["eps"]))
        # too small: left as it is; too large: shrunk (tensor ops, no wait for the device)
        rms = state["param_rms"]
        scale_step = torch.where(rms < group["param_min_rms"], 0.0, scale_step)
        scale_step = torch.where(rms > group["param_max_rms"], -size_lr * period, scale_step)
        state["delta"].add_(p.float() * scale_step, alpha=1 - beta1)

    @staticmethod
    def _tensor_step(group: dict, grad: torch.Tensor, state: dict) -> None:
        beta1, beta2 = group["betas"]
        exp_avg_sq = state["exp_avg_sq"]
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        correction = 1 - beta2 ** (state["step"] + 1)
        denom = (exp_avg_sq / correction if correction < 0.99 else exp_avg_sq).sqrt()
        alpha = -group["lr"] * (1 - beta1) * state["param_rms"].clamp(min=group["param_min_rms"])
        state["delta"].add_(grad / (denom + group["eps"]) * alpha)

    @staticmethod
    def _scalar_step(group: dict, p: torch.Tensor, grad: torch.Tensor, state: dict) -> None:
        beta1, beta2 = group["betas"]
        exp_avg_sq = state["exp_avg_sq"]
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq / (1 - beta2 ** (state["step"] + 1))).sqrt() + group["eps"]
        lr = group["lr"] * group["scalar_lr_scale"]
        state["delta"].add_(grad / denom, alpha=-lr * (1 - beta1))
        p.clamp_(min=-group["scalar_max"], max=group["scalar_max"])
