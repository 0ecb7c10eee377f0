"""--pad_to_frames: training batches padded to a multiple of N feature frames (and their tokens to a
multiple of 8), so that they take few shapes: the padding changes no loss or gradient, frame
budgets count it, the epoch's log line gives it, and a run trains with it."""
import logging

import pytest
import torch

from konkanivani.config import TrainConfig, model_config_from_preset
from konkanivani.data.dataset import TOKEN_MULTIPLE, Example, collate
from konkanivani.data.features import KaldiFbank, LogMel
from konkanivani.data.frames import frames_of, frames_of_samples, padded_frames
from konkanivani.data.samplers import DurationBucketSampler, padding_fraction
from konkanivani.model.asr import ASRModel
from konkanivani.training.loop import train
from konkanivani.training.objective import Objective
from konkanivani.training.precision import resolve_precision
from konkanivani.training.step import forward_backward

CPU = torch.device("cpu")


def _examples(seed=0):
    g = torch.Generator().manual_seed(seed)
    samples = [16000 + 3210 * i for i in range(3)]
    token_lens = [5, 9, 3]
    return [Example(0.1 * torch.randn(n, generator=g), torch.randint(3, 30, (u,), generator=g),
                    i, float("nan")) for i, (n, u) in enumerate(zip(samples, token_lens))]


def test_a_padded_batch_is_a_multiple_of_the_frames_and_of_eight_tokens():
    plain, padded = collate(_examples()), collate(_examples(), pad_to_frames=50)
    assert padded.audio.shape[1] % (50 * 160) == 0 and padded.audio.shape[1] > plain.audio.shape[1]
    assert padded.tokens.shape[1] % TOKEN_MULTIPLE == 0
    assert torch.equal(padded.audio_lens, plain.audio_lens)
    assert torch.equal(padded.token_lens, plain.token_lens)
    assert (padded.tokens[:, plain.tokens.shape[1]:] == -1).all()
    for frontend in (LogMel(80), KaldiFbank(80)):
        feats, lens = padded.features(frontend)
        plain_feats, plain_lens = plain.features(frontend)
        assert torch.equal(lens, plain_lens)
        assert feats.shape[1] > plain_feats.shape[1] and feats.shape[1] % 50 in (0, 1)
        assert torch.equal(feats[:, :plain_feats.shape[1]], plain_feats)
        assert not feats[:, plain_feats.shape[1]:].any()



def test_a_padded_batch_has_the_frames_the_budgets_count():
    for samples in range(16000, 16000 + 50 * 160 * 2, 37):
        batch = collate([Example(torch.zeros(samples), torch.tensor([3]), 0)], pad_to_frames=50)
        assert frames_of_samples(batch.audio.shape[1]) == padded_frames(
            frames_of_samples(samples), 50), samples
        assert batch.audio.shape[1] >= samples

@pytest.mark.parametrize("frontend", ["log_mel", "kaldi_fbank"])
def test_the_padding_changes_no_loss_or_gradient(frontend):
    torch.manual_seed(0)
    model = ASRModel(model_config_from_preset("tiny", vocab_size=40, dropout=0.0))
    front = LogMel(80) if frontend == "log_mel" else KaldiFbank(80)
    precision = resolve_precision(CPU, False, "fp32")
    scaler = torch.amp.GradScaler("cpu", enabled=False)

    def update(batch):
        model.zero_grad()
        stats = forward_backward(model, [batch], CPU, precision, scaler, Objective(),
                                 frontend=front)
        return float(stats["loss"]), {n: p.grad.clone() for n, p in model.named_parameters()
                                      if p.grad is not None}

    loss, grads = update(collate(_examples()))
    padded_loss, padded_grads = update(collate(_examples(), pad_to_frames=64))
    assert padded_loss == pytest.approx(loss, rel=1e-5)
    for name, grad in grads.items():
        err = (padded_grads[name] - grad).abs().max().item()
        assert err <= 1e-4 * grad.abs().max().item() + 1e-7, name


def test_frame_budgets_and_the_padding_share_count_the_padding():
    durations = [1.0 + 0.37 * i for i in range(40)]
    frames = [frames_of(d) for d in durations]
    sampler = DurationBucketSampler(durations, max_frames=3000, seed=1, num_buckets=4,
                                    pad_to_frames=200)
    batches = sampler.epoch_batches()
    assert sorted(i for b in batches for i in b) == list(range(40))
    assert all(len(b) * padded_frames(max(frames[i] for i in b), 200) <= 3000 for b in batches)
    plain = DurationBucketSampler(durations, max_frames=3000, seed=1, num_buckets=4)
    assert len(batches) > len(plain.epoch_batches())  # fewer utterances fit a padded batch
    assert padding_fraction(batches, frames, 200) > padding_fraction(batches, frames) >= 0


def test_a_run_trains_with_padded_batches(tiny_corpus, tmp_path, caplog):
    cfg = TrainConfig(train_manifest=str(tiny_corpus / "train.jsonl"),
                      valid_manifest=str(tiny_corpus / "valid.jsonl"),
                      output_dir=str(tmp_path / "run"), preset="tiny", tokenizer_type="char",
                      batch_size=4, max_steps=3, num_workers=1, progress=False,
                      tensorboard=False, pad_to_frames=100, validate_every_steps=0)
    with caplog.at_level(logging.INFO, logger="konkanivani"):
        summary = train(cfg)
    assert summary["step"] == 3
    line = next(m for m in caplog.messages if "of their frames padding" in m)
    share = float(line.split("batches, ")[1].split("%")[0])
    assert share > 5.0, line  # a tenth of a second's frames a batch, at the least


def test_the_padding_benchmark_counts_shapes_and_padding(tmp_path, capsys):
    from benchmark_modules import load

    manifest = tmp_path / "train.jsonl"
    manifest.write_text("".join(
        f'{{"audio_filepath": "a{i}.wav", "duration": {1 + 0.173 * i:.3f}, "text": "x"}}\n'
        for i in range(64)), encoding="utf-8")
    assert load("padding").main([str(manifest), "--multiples", "0,50", "--batch_size", "2",
                                 "--out", str(tmp_path / "table.md")]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()[2:]]
    plain, padded = (r for r in rows if r[0].strip() == "2 utterances")
    assert int(padded[4]) < int(plain[4])  # fewer frame lengths
    assert float(padded[3].strip(" %")) > float(plain[3].strip(" %"))  # for more padding
    assert (tmp_path / "table.md").read_text().startswith("    python3 benchmarks/padding.py")
