import copy

import torch

from konkanivani.config import model_config_from_preset
from konkanivani.data.dataset import Batch
from konkanivani.model.asr import ASRModel
from konkanivani.training.precision import resolve_precision
from konkanivani.training.step import forward_backward, optimizer_step


def _batches(n_utts, per_batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(60, 160, (n_utts,), generator=g)
    tok_lens = torch.randint(2, 8, (n_utts,), generator=g)
    audio = 0.1 * torch.randn(n_utts, 159 * 160, generator=g)  # waveforms of `lens` feature frames
    samples = (lens - 1) * 160
    tokens = torch.randint(3, 40, (n_utts, 8), generator=g)
    out = []
    for s in range(0, n_utts, per_batch):
        idx = list(range(s, min(s + per_batch, n_utts)))
        N, U = int(samples[idx].max()), int(tok_lens[idx].max())
        tok = tokens[idx, :U].clone()
        tok[torch.arange(U) >= tok_lens[idx, None]] = -1
        out.append(Batch(audio[idx, :N], samples[idx], tok, tok_lens[idx], idx))
    return out


def _assert_close(a, b, name, atol=1e-8):
    # Summation order differs between the two paths: allow float noise relative to the tensor's
    # scale.
    err, scale = (a - b).abs().max().item(), b.abs().max().item()
    assert err <= 1e-5 * scale + atol, f"{name}: max difference {err:.3g} at scale {scale:.3g}"


def _update(model, batches):
    """One optimizer step. Plain SGD, so the update is the (clipped) gradient itself: Adam would
    turn float noise in near-zero gradients into steps of the full learning rate."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    device = torch.device("cpu")
    precision = resolve_precision(device, False)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    stats = {k: float(v) for k, v in forward_backward(model, batches, device, precision,
                                                      scaler).items()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    optimizer_step(model, opt, scaler, grad_clip=1.0)
    return stats, grads, model


def test_accumulating_4x2_equals_1x8():
    torch.manual_seed(0)
    model = ASRModel(model_config_from_preset("tiny", vocab_size=40, dropout=0.0))
    stats_small, grads_small, after_small = _update(model, _batches(8, 2))
    stats_big, grads_big, after_big = _update(model, _batches(8, 8))
    assert abs(stats_small["loss"] - stats_big["loss"]) < 1e-4 * abs(stats_big["loss"])
    # the update's utterances and audio as they are, however they were split
    seconds = round(sum(int(b.audio_lens.sum()) for b in _batches(8, 8)) / 16000, 2)
    assert stats_small["utterances"] == stats_big["utterances"] == 8
    assert stats_small["audio_s"] == stats_big["audio_s"] == seconds > 0
    assert grads_small.keys() == grads_big.keys()
    for name in grads_big:
        _assert_close(grads_small[name], grads_big[name], name)
    moved = 0.0
    for (name, p_small), p_big, p0 in zip(
        after_small.named_parameters(), after_big.parameters(), model.parameters()
    ):
        # atol: rounding of weights near 1 in float32 (the update is a difference of two such
        # numbers)
        _assert_close(p_small - p0, p_big - p0, name, atol=2e-7)
        moved = max(moved, (p_big - p0).abs().max().item())
    assert moved > 1e-3  # the step did change the weights


def test_uneven_micro_batches_are_weighted_by_utterances():
    """A group of 3 + 3 + 1 utterances still gives the update of one batch of 7."""
    torch.manual_seed(1)
    model = ASRModel(model_config_from_preset("tiny", vocab_size=40, dropout=0.0))
    big = _batches(7, 7)
    uneven = _batches(7, 3)  # 3, 3, 1
    _, grads_uneven, _ = _update(model, uneven)
    _, grads_big, _ = _update(model, big)
    for name in grads_big:
        _assert_close(grads_uneven[name], grads_big[name], name)
