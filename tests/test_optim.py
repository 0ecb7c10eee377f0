"""The optimizer and the LR schedule (training/optim.py, training/scaled_adam.py): Eden's
factor, and ScaledAdam learning, moving each tensor relative to its scale and resuming exactly."""
import copy

import pytest
import torch

from konkanivani.config import TrainConfig
from konkanivani.training.optim import build_optimizer, eden_factor, scheduled_lr
from konkanivani.training.scaled_adam import ScaledAdam


def test_the_eden_schedule_warms_from_half_and_decays_in_steps_and_epochs():
    assert eden_factor(0, 0, 100, 7500, 3.5) == 0.5
    assert eden_factor(50, 0, 100, 7500, 3.5) == pytest.approx(0.75 * (1 + (50 / 7500) ** 2)
                                                               ** -0.25)
    assert eden_factor(7500, 0, 100, 7500, 3.5) == pytest.approx(2 ** -0.25)
    assert eden_factor(100, 3.5, 100, 10**9, 3.5) == pytest.approx(2 ** -0.25)
    later = [eden_factor(s, e, 100, 7500, 3.5) for s, e in ((200, 0), (400, 1), (800, 2))]
    assert later == sorted(later, reverse=True)
    cfg = TrainConfig(train_manifest="t", valid_manifest="v", lr=4e-3, warmup_steps=400)
    assert scheduled_lr(cfg, 1499, 6) == pytest.approx(4e-3 * (400 / 1500) ** 0.5)  # noam
    cfg.lr_schedule = "eden"
    assert scheduled_lr(cfg, 1500, 6) == pytest.approx(
        4e-3 * (1 + (1500 / 7500) ** 2) ** -0.25 * (1 + (6 / 3.5) ** 2) ** -0.25)


def _regression(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 1))
    model.register_parameter("gain", torch.nn.Parameter(torch.ones(())))  # a one-entry tensor
    x = torch.randn(128, 12)
    return model, x, x[:, :3].sum(1, keepdim=True)


def _steps(model, opt, x, y, n):
    losses = []
    for _ in range(n):
        opt.zero_grad()
        loss = ((model(x) * model.gain - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_scaled_adam_learns_moves_tensors_relative_to_their_scale_and_resumes_exactly():
    model, x, y = _regression()
    opt, name = build_optimizer("scaledadam", model.parameters(), torch.device("cpu"), 0.03, 0.01)
    assert name == "scaled_adam" and isinstance(opt, ScaledAdam)
    losses = _steps(model, opt, x, y, 150)
    assert losses[-1] < 0.02 * losses[0]
    # the first update of a matrix is lr * (1 - beta1) * its RMS in every entry (Adam's normalized
    # gradient is +-1 at step 1), whatever that RMS is
    for scale in (1.0, 10.0):
        w = torch.nn.Parameter(torch.randn(8, 8) * scale)
        before, rms = w.detach().clone(), w.detach().pow(2).mean().sqrt()
        w.grad = torch.randn(8, 8)
        ScaledAdam([w], lr=0.03).step()
        assert torch.allclose((w.detach() - before).abs(), 0.03 * 0.1 * rms.expand(8, 8),
                              rtol=1e-4)
    # a copy resumed from the state dict after 40 steps takes the same steps as the unbroken one
    model, x, y = _regression(1)
    opt = ScaledAdam(model.parameters(), lr=0.03)
    _steps(model, opt, x, y, 40)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    unbroken = _steps(model, opt, x, y, 30)
    resumed_model, _, _ = _regression(2)
    resumed_model.load_state_dict(saved_model)
    resumed_opt = ScaledAdam(resumed_model.parameters(), lr=0.03)
    resumed_opt.load_state_dict(saved_opt)
    assert _steps(resumed_model, resumed_opt, x, y, 30) == unbroken


def test_scaled_adam_shrinks_a_tensor_above_its_largest_scale():
    w = torch.nn.Parameter(torch.full((4, 4), 5.0))  # RMS 5 > param_max_rms 3
    opt = ScaledAdam([w], lr=0.05, size_update_period=2)
    for _ in range(20):
        w.grad = torch.zeros(4, 4)  # nothing but the scale's limit moves it
        opt.step()
    assert 0 < w.detach().max() < 5.0
