"""The memory options one by one: optimizer choice, gradient checkpointing, precision, dynamic
batches and their sampler, out-of-memory recovery, and the memory estimator."""
import copy
import logging
import sys

import pytest
import torch
from test_accumulation import _assert_close, _batches

from konkanivani.config import model_config_from_preset
from konkanivani.data.features import LogMel
from konkanivani.data.frames import frames_of
from konkanivani.data.samplers import (
    DurationBucketSampler,
    LengthGroupedBatchSampler,
    PreflightSampler,
    padding_fraction,
    select_samples,
    split_batch,
)
from konkanivani.model.asr import ASRModel, SpecAugment
from konkanivani.model.conformer import LayerNorm
from konkanivani.training import precision as precision_module
from konkanivani.training.memory import BatchDoesNotFit, MemoryEstimator, is_out_of_memory
from konkanivani.training.objective import Objective
from konkanivani.training.optim import build_optimizer
from konkanivani.training.precision import resolve_precision
from konkanivani.training.step import forward_backward, optimizer_step

CPU = torch.device("cpu")


def _tiny(seed=0, dropout=0.0):
    torch.manual_seed(seed)
    return ASRModel(model_config_from_preset("tiny", vocab_size=40, dropout=dropout))


# ---- optimizer ---------------------------------------------------------------------------------

@pytest.mark.parametrize("spelling", ["adamw_8bit", "adamw8bit"])
def test_8bit_adamw_both_spellings(spelling):
    pytest.importorskip("bitsandbytes")
    model = torch.nn.Linear(128, 64)  # 8192 weights: large enough for 8-bit states
    opt, name = build_optimizer(spelling, model.parameters(), CPU, lr=1e-2, weight_decay=0.0)
    assert name == "adamw_8bit" and type(opt).__name__ == "AdamW8bit"
    before = model.weight.detach().clone()
    model(torch.randn(4, 128)).pow(2).sum().backward()
    opt.step()
    assert not torch.equal(before, model.weight)
    assert opt.state[model.weight]["state1"].dtype == torch.uint8  # the moments really are 8-bit


def test_8bit_adamw_falls_back_to_adamw_with_a_warning(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import now raises ImportError
    model = torch.nn.Linear(8, 8)
    with caplog.at_level(logging.WARNING, logger="konkanivani"):
        opt, name = build_optimizer("adamw8bit", model.parameters(), CPU, lr=1e-3, weight_decay=0.0)
    assert name == "adamw" and type(opt) is torch.optim.AdamW
    assert "bitsandbytes is not installed" in caplog.text and "standard AdamW" in caplog.text
    with pytest.raises(ValueError, match="adamw_8bit"):
        build_optimizer("sgd", model.parameters(), CPU, lr=1e-3, weight_decay=0.0)


# ---- gradient checkpointing and precision -------------------------------------------------------

def test_checkpointed_gradients_equal_plain_ones():
    """With dropout on: the recomputation draws the same masks."""
    model = _tiny(dropout=0.1)
    batch = _batches(3, 3)
    grads = []
    for checkpointed in (False, True):
        m = copy.deepcopy(model)
        m.set_gradient_checkpointing(checkpointed)
        torch.manual_seed(7)
        feats, feat_lens = batch[0].features(LogMel())
        out = Objective(spec_augment=SpecAugment())(m, feats, feat_lens, batch[0].tokens,
                                                    batch[0].token_lens)
        out.loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    for name, g in grads[0].items():
        _assert_close(grads[1][name], g, name)


def test_activations_offloaded_to_cpu_memory_give_the_same_gradients():
    """--offload_activations (save_on_cpu) changes where the saved tensors wait, not the numbers;
    on a CPU device the run itself refuses it (nothing to gain there)."""
    from konkanivani.training.precision import Precision

    model = _tiny(dropout=0.0)
    batches = _batches(6, 3)
    grads = []
    for offload in (False, True):
        m = copy.deepcopy(model)
        stats = forward_backward(
            m,
            batches,
            CPU,
            Precision(None, False, ""),
            torch.amp.GradScaler("cpu", enabled=False),
            offload_activations=offload,
        )
        grads.append(({n: p.grad for n, p in m.named_parameters()}, float(stats["loss"])))
    assert grads[0][1] == grads[1][1]
    for name, g in grads[0][0].items():
        _assert_close(grads[1][0][name], g, name)


def test_explicit_precision(monkeypatch):
    monkeypatch.setattr(precision_module, "cpu_bf16_speed_ratio", lambda: 0.005)
    slow_bf16 = resolve_precision(CPU, False, "bf16")  # asked for outright: runs, with a warning
    assert slow_bf16.dtype == torch.bfloat16 and slow_bf16.slow and "far slower" in slow_bf16.note
    # --precision overrides --mixed_precision
    assert resolve_precision(CPU, True, "fp32").dtype is None
    fp16 = resolve_precision(CPU, False, "fp16")
    assert fp16.dtype == torch.float16 and fp16.use_scaler
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    cuda_bf16 = resolve_precision(torch.device("cuda"), False, "bf16")
    assert cuda_bf16.dtype == torch.bfloat16 and not cuda_bf16.use_scaler and not cuda_bf16.slow
    with pytest.raises(ValueError, match="fp32, fp16, bf16"):
        resolve_precision(CPU, False, "fp8")


def test_norms_stay_fp32_under_autocast():
    norm = LayerNorm(8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = torch.nn.Linear(8, 8)(torch.randn(2, 8))
        assert h.dtype == torch.bfloat16 and norm(h).dtype == torch.float32
    x = torch.randn(2, 8)
    torch.testing.assert_close(
        norm(x), torch.nn.functional.layer_norm(x, (8,), norm.weight, norm.bias)
    )


# ---- dynamic batches ---------------------------------------------------------------------------

def _durations(n=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, generator=g) * 14 + 1).tolist()


def test_bucketed_batches_cover_the_epoch_within_budget_and_pad_little():
    durations = _durations()
    frames = [frames_of(d) for d in durations]
    sampler = DurationBucketSampler(durations, max_frames=4000, seed=3)
    batches = sampler.epoch_batches()
    assert sorted(i for b in batches for i in b) == list(range(len(durations)))
    assert all(len(b) * max(frames[i] for i in b) <= 4000 for b in batches)
    # no length grouping
    fixed = LengthGroupedBatchSampler(durations, 4, seed=3, pool_batches=1).epoch_batches()
    assert padding_fraction(batches, frames) < 0.5 * padding_fraction(fixed, frames)
    again = DurationBucketSampler(durations, max_frames=4000, seed=3).epoch_batches()
    assert again == batches  # deterministic by seed
    sampler.set_epoch(1)
    assert sampler.epoch_batches() != batches  # reshuffled each epoch
    assert DurationBucketSampler(durations, 4000, seed=4).epoch_batches() != batches


def test_an_utterance_over_the_budget_goes_alone_and_the_cap_is_kept():
    sampler = DurationBucketSampler([1.0, 1.0, 30.0, 2.0], max_frames=1000, shuffle=False)
    assert [3 - len(b) for b in sampler.epoch_batches()] == [0, 2]  # [1 s, 1 s, 2 s], [30 s]
    capped = DurationBucketSampler(
        [1.0] * 10, max_frames=10**6, shuffle=False, fits=lambda n, t: n <= 3
    )
    assert [len(b) for b in capped.epoch_batches()] == [3, 3, 3, 1]


@pytest.mark.parametrize("preflight", [False, True])
def test_sampler_resumed_mid_epoch_yields_exactly_the_remaining_batches(preflight):
    durations = _durations(120)

    def make():
        sampler = DurationBucketSampler(durations, max_frames=3000, seed=9)
        return PreflightSampler(sampler, durations, 3) if preflight else sampler

    whole = make()
    whole.set_epoch(0)
    batches = list(whole)
    stopped = make()
    stopped.set_epoch(0)
    it = iter(stopped)
    seen = [next(it) for _ in range(7)]
    state = stopped.state_dict() | {"start": len(seen)}
    resumed = make()
    resumed.load_state_dict(state)
    assert len(resumed) == len(batches) - 7
    assert seen + list(resumed) == batches


def test_preflight_puts_the_largest_batches_first_in_the_first_epoch_only():
    durations = _durations(200)
    frames = [frames_of(d) for d in durations]
    cost = [
        len(b) * max(frames[i] for i in b)
        for b in LengthGroupedBatchSampler(durations, 4).epoch_batches()
    ]
    sampler = PreflightSampler(LengthGroupedBatchSampler(durations, 4), durations, 3)
    sampler.set_epoch(0)
    first = [len(b) * max(frames[i] for i in b) for b in sampler.epoch_batches()[:3]]
    assert first == sorted(cost, reverse=True)[:3]
    sampler.set_epoch(1)
    inner = LengthGroupedBatchSampler(durations, 4)
    inner.set_epoch(1)
    assert sampler.epoch_batches() == inner.epoch_batches()


def test_split_batch_and_select_samples():
    batch = _batches(5, 5)[0]
    a, b = split_batch(batch)
    assert a.indices + b.indices == batch.indices
    assert a.audio.shape[1] == int(a.audio_lens.max()) and b.tokens.shape[1] == int(
        b.token_lens.max()
    )
    small, large = select_samples(100, 30, seed=1), select_samples(100, 60, seed=1)
    assert (
        len(small) == 30
        and set(small) <= set(large)
        and select_samples(100, 0, seed=1) == list(range(100))
    )
    assert select_samples(100, 30, seed=2) != small


# ---- out-of-memory recovery --------------------------------------------------------------------

class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")


def _oom_on(model, size, where):
    """Make ``model`` run out of memory once, on the first micro-batch of ``size`` utterances:
    in the forward pass, or in the backward pass after the decoder's gradients are in."""
    state = {"armed": True}
    encode = model.encode

    def failing_encode(feats, feat_lens, augment=None):
        if state["armed"] and len(feats) == size:
            state["armed"] = False
            if where == "forward":
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            enc, lens = encode(feats, feat_lens, augment)
            return _RaiseInBackward.apply(enc), lens
        return encode(feats, feat_lens, augment)

    model.encode = failing_encode
    return state


def _step(model, batches, oom=None):
    model = copy.deepcopy(model)
    state = _oom_on(model, *oom) if oom else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    stats = forward_backward(model, batches, CPU, resolve_precision(CPU, False), scaler)
    optimizer_step(model, opt, scaler, grad_clip=1.0)
    assert state is None or not state["armed"]  # the simulated error did happen
    return stats, model


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_out_of_memory_splits_the_micro_batch_and_keeps_the_update(where, caplog):
    model = _tiny(1)
    batches = _batches(8, 4)  # two micro-batches of 4; the second runs out of memory
    stats, plain = _step(model, batches)
    with caplog.at_level(logging.WARNING, logger="konkanivani"):
        stats_oom, recovered = _step(model, batches, oom=(4, where))
    assert "out of memory on a micro-batch of 4 utterances" in caplog.text
    assert float(stats_oom["loss"]) == pytest.approx(float(stats["loss"]), rel=1e-5)
    for (name, p), q in zip(plain.named_parameters(), recovered.parameters()):
        _assert_close(q - model.get_parameter(name), p - model.get_parameter(name), name, atol=2e-7)


def test_a_single_utterance_that_does_not_fit_stops_with_its_name():
    model = _tiny(2)
    _oom_on(model, 1, "forward")
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    with pytest.raises(BatchDoesNotFit, match=r"train.jsonl:17 \(\d+ frames\) does not fit"):
        forward_backward(model, _batches(1, 1), CPU, resolve_precision(CPU, False), scaler,
                         name_of=lambda i: "train.jsonl:17")
    assert is_out_of_memory(
        RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate")
    )
    assert not is_out_of_memory(RuntimeError("shape mismatch"))


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_plan_memory_prints_the_table_and_flags_that_fit(device, capsys):
    from konkanivani.cli import plan_memory

    assert plan_memory.main(["--preset", "large", "--gpu_gb", "15", "--device", device]) == 0
    out = capsys.readouterr().out
    assert (
        "optimizer (adamw)" in out
        and "activations: encoder" in out
        and "--preset large --max_batch_frames" in out
    )
    flags = out.split("recommended")[1].splitlines()[1].split()
    frames = int(flags[flags.index("--max_batch_frames") + 1])
    est = MemoryEstimator(model_config_from_preset("large", vocab_size=128), device=device)
    # 20 s utterances, 25% margin
    assert est.peak_bytes(frames // 2001, 2001) <= 0.75 * 15 * 2 ** 30
    # nothing fits
    assert plan_memory.main(["--preset", "large", "--gpu_gb", "0.3", "--device", device]) == 1
