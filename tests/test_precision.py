import torch

from konkanivani.training import precision as precision_module
from konkanivani.training.optim import lr_factor
from konkanivani.training.precision import resolve_precision
from konkanivani.training.step import maybe_empty_cache


def test_fp32_unless_asked():
    p = resolve_precision(torch.device("cpu"), mixed_precision=False)
    assert p.dtype is None and not p.use_scaler


def test_cuda_mixed_precision_is_fp16_with_scaler():
    p = resolve_precision(torch.device("cuda"), mixed_precision=True)
    assert p.dtype == torch.float16 and p.use_scaler


def test_cpu_bf16_only_where_it_is_fast(monkeypatch):
    monkeypatch.setattr(precision_module, "cpu_bf16_speed_ratio", lambda: 0.005)
    slow = resolve_precision(torch.device("cpu"), mixed_precision=True)
    assert slow.dtype is None and "no fast bf16" in slow.note
    monkeypatch.setattr(precision_module, "cpu_bf16_speed_ratio", lambda: 0.5)
    fast = resolve_precision(torch.device("cpu"), mixed_precision=True)
    assert fast.dtype == torch.bfloat16 and not fast.use_scaler
    with fast.autocast(torch.device("cpu")):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


def test_probe_measures_a_ratio():
    ratio = precision_module.cpu_bf16_speed_ratio()
    _, flags = precision_module._cpuinfo()
    if "avx2" in flags and not flags & {"avx512_bf16", "amx_bf16"}:
        assert ratio == 0.0  # an x86 CPU without native bf16 is not measured
    else:
        assert 0 < ratio < 10


def test_the_probe_leaves_the_global_generator_alone():
    # A probe after a run's seeding used to draw from it: the first run in a process then started
    # from other weights than a second one of the same seed (a sweep's trials, a benchmark's runs).
    torch.manual_seed(7)
    state = torch.get_rng_state()
    precision_module._matmul_seconds(torch.float32, size=8, seconds=0.0)
    precision_module._matmul_seconds(torch.bfloat16, size=8, seconds=0.0)
    assert torch.equal(torch.get_rng_state(), state)


def test_an_x86_cpu_without_bf16_flags_never_gets_bf16_whatever_a_busy_probe_measures(monkeypatch):
    monkeypatch.setattr(
        precision_module, "_cpuinfo", lambda: ("AMD EPYC", frozenset({"avx2", "fma"}))
    )
    monkeypatch.setattr(
        precision_module, "_matmul_seconds", lambda dtype, size=256, seconds=0.02: 1e-3
    )
    assert precision_module.cpu_bf16_speed_ratio.__wrapped__() == 0.0
    monkeypatch.setattr(
        precision_module, "_cpuinfo", lambda: ("Xeon", frozenset({"avx2", "avx512_bf16"}))
    )
    threads = torch.get_num_threads()
    assert precision_module.cpu_bf16_speed_ratio.__wrapped__() == 1.0
    assert torch.get_num_threads() == threads


def test_probe_keeps_the_fastest_product_of_each_dtype_on_a_busy_machine(monkeypatch):
    """True times: fp32 1 ms, bf16 0.5 ms (ratio 2). A busy machine slows some measurements down
    (never speeds one up): the fp32 ones by 30x in the first rounds, bf16 in the last."""
    slow = {torch.float32: [30, 30, 1, 30, 1, 1], torch.bfloat16: [1, 1, 1, 1, 3, 5]}
    true = {torch.float32: 1e-3, torch.bfloat16: 5e-4}

    def fake_seconds(dtype, size=256, seconds=0.02):
        return true[dtype] * slow[dtype].pop(0)

    monkeypatch.setattr(precision_module, "_matmul_seconds", fake_seconds)
    monkeypatch.setattr(
        precision_module, "_cpuinfo", lambda: ("Xeon", frozenset({"avx2", "amx_bf16"}))
    )
    assert precision_module.cpu_bf16_speed_ratio.__wrapped__(rounds=5) == 2.0
    # one warm-up and 5 rounds of each, alternating
    assert slow == {torch.float32: [], torch.bfloat16: []}


def test_the_precision_note_names_the_cpu(monkeypatch):
    described = precision_module.cpu_description()
    assert described and "  " not in described
    monkeypatch.setattr(precision_module, "cpu_bf16_speed_ratio", lambda: 0.01)
    assert described in resolve_precision(torch.device("cpu"), mixed_precision=True).note
    monkeypatch.setattr(precision_module, "cpu_bf16_speed_ratio", lambda: 2.3)
    note = resolve_precision(torch.device("cpu"), mixed_precision=True).note
    assert described in note and "2.30x fp32" in note


def test_disabled_grad_scaler_is_a_plain_step_on_cpu():
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.5)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    scaler.scale((w * 2).sum()).backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert w.tolist() == [0.0, 0.0]


def test_empty_cache_every_n_batches_on_cuda_only(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    emptied = [b for b in range(1, 201) if maybe_empty_cache(cuda, b, 50)]
    assert emptied == [50, 100, 150, 200] and len(calls) == 4
    assert not any(maybe_empty_cache(cpu, b, 50) for b in range(1, 101))
    assert not any(maybe_empty_cache(cuda, b, 0) for b in range(1, 101))
    assert len(calls) == 4


def test_lr_schedule_warms_up_then_decays():
    factors = [lr_factor(s, warmup_steps=10) for s in range(40)]
    assert factors[0] == 0.1 and factors[9] == 1.0
    assert all(a < b for a, b in zip(factors[:9], factors[1:10]))
    assert all(a > b for a, b in zip(factors[9:], factors[10:]))
    assert abs(factors[39] - 0.5) < 1e-9  # sqrt(10 / 40)


def test_bf16_autocast_trains_and_validates_on_cpu():
    """The whole step and validation run under bf16 autocast (losses in fp32)."""
    from types import SimpleNamespace

    from konkanivani.config import model_config_from_preset
    from konkanivani.data.dataset import Batch
    from konkanivani.data.tokenizer import train_tokenizer
    from konkanivani.model.asr import ASRModel, SpecAugment
    from konkanivani.training.objective import Objective
    from konkanivani.training.precision import Precision
    from konkanivani.training.step import forward_backward, optimizer_step, validate

    texts = ["हांव घरा वता", "तूं कितें करता"]
    tok = train_tokenizer(texts, vocab_size=30)
    ids = [tok.encode(t) for t in texts]
    U = max(map(len, ids))
    tokens = torch.tensor([i + [-1] * (U - len(i)) for i in ids])
    batch = Batch(0.1 * torch.randn(2, 119 * 160), torch.tensor([119 * 160, 99 * 160]), tokens,
                  torch.tensor([len(i) for i in ids]), [0, 1])
    torch.manual_seed(0)
    model = ASRModel(model_config_from_preset("tiny", vocab_size=tok.vocab_size))
    bf16 = Precision(torch.bfloat16, False, "bf16")
    cpu = torch.device("cpu")
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stats = forward_backward(model, [batch], cpu, bf16, scaler,
                             Objective(spec_augment=SpecAugment()))
    assert all(torch.isfinite(torch.as_tensor(v)) for v in stats.values())
    assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)
    assert torch.isfinite(optimizer_step(model, opt, scaler, 5.0))
    utts = [SimpleNamespace(text=t) for t in texts]
    metrics = validate(model, [batch], tok, utts, cpu, bf16)
    assert metrics.keys() == {"loss", "ctc", "attention", "wer", "cer"}
    assert metrics["loss"] > 0
