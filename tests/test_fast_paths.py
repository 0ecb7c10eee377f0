"""The GPU's fast paths, checked on the CPU: the padding of frames and tokens to a multiple of
``ALIGN`` (done on CUDA) changes no real frame, loss or gradient, and the compiled layers
(``--compile``) compute what the eager ones do."""
import copy

import pytest
import torch

from konkanivani.config import model_config_from_preset
from konkanivani.model import conformer, decoder
from konkanivani.model.asr import ASRModel, SpecAugment
from konkanivani.training.compile import compiled, compiled_layers
from konkanivani.training.ema import make_ema
from konkanivani.training.objective import Objective


def _batch(vocab: int = 40):
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(3, 157, 80, generator=g)
    feat_lens = torch.tensor([157, 121, 98])
    tokens = torch.randint(3, vocab, (3, 7), generator=g)
    tokens[1, 5:] = -1
    tokens[2, 3:] = -1
    return feats, feat_lens, tokens, torch.tensor([7, 5, 3])


def _model(seed: int = 0) -> ASRModel:
    torch.manual_seed(seed)
    return ASRModel(model_config_from_preset("tiny", vocab_size=40, dropout=0.0)).train()


def _loss_and_grads(model, forward=None):
    out = Objective()(forward or model, *_batch())
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out, grads


def test_padding_to_the_alignment_changes_no_real_frame_loss_or_gradient(monkeypatch):
    model = _model()
    out, grads = _loss_and_grads(model)
    enc, lens = model.encode(*_batch()[:2])

    def aligned(length, device):  # what CUDA does, here on the CPU
        return -(-length // conformer.ALIGN) * conformer.ALIGN

    monkeypatch.setattr(conformer, "aligned_length", aligned)
    monkeypatch.setattr(decoder, "aligned_length", aligned)
    padded_out, padded_grads = _loss_and_grads(model)
    padded_enc, padded_lens = model.encode(*_batch()[:2])
    assert enc.shape[1] % conformer.ALIGN and padded_enc.shape[1] % conformer.ALIGN == 0
    assert torch.equal(lens, padded_lens)
    for i, n in enumerate(lens.tolist()):
        torch.testing.assert_close(padded_enc[i, :n], enc[i, :n], atol=1e-5, rtol=1e-5)
    for name in ("loss", "ctc", "attention"):
        torch.testing.assert_close(
            getattr(padded_out, name), getattr(out, name), atol=1e-4, rtol=1e-5
        )
    assert grads.keys() == padded_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(padded_grads[name], grad, atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.slow  # inductor builds C++ kernels for the two layer kinds: about a minute on 2 cores
def test_compiled_layers_compute_what_the_eager_ones_do_and_the_average_stays_eager():
    eager = _model()
    model = copy.deepcopy(eager)
    forward = compiled(model)
    assert len(compiled_layers(model)) == 3  # the tiny preset: 2 encoder blocks, 1 decoder layer
    ema = make_ema(model, 0.9)
    assert not any("forward" in m.__dict__ for m in ema.module.modules())
    for _ in range(2):  # the second call reuses the compiled graphs
        want, want_grads = _loss_and_grads(eager)
        got, got_grads = _loss_and_grads(model, forward)
        torch.testing.assert_close(got.loss, want.loss, atol=1e-4, rtol=1e-5)
        for name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[name], grad, atol=1e-4, rtol=1e-4, msg=name)
    # no fallback to eager
    assert all("forward" in layer.__dict__ for layer in compiled_layers(model))


def test_the_loss_and_mask_ramps_compile_the_layers_once(monkeypatch):
    """``--compile`` with --label_smoothing_from, --ctc_weight_from and --spec_augment_ramp_steps:
    the ramps set the losses' and SpecAugment's values, which stay eager around the compiled
    layers, so a new value each step compiles nothing again (a counting backend: one graph per
    layer kind over 12 steps)."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile",
                        lambda fn, **kw: real_compile(fn, **{**kw, "backend": counter}))
    model = _model()
    forward = compiled(model)
    objective = Objective(ctc_weight=0.5, ctc_weight_from=0.9, label_smoothing=0.1,
                          label_smoothing_from=0.0, loss_ramp_steps=11,
                          spec_augment=SpecAugment(), spec_augment_ramp_steps=11)
    for step in range(12):
        objective(forward, *_batch(), step=step).loss.backward()
    assert counter.frame_count == 2  # one encoder block, one decoder layer
    torch._dynamo.reset()
