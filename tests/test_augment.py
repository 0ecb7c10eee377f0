"""On-the-fly augmentation: lengths and labels, seeding, SNR, alignment, VTLP, batching budgets,
flag checks, the corrupted manifest, and an exact resume with every augmentation on."""
import json
import logging
import math

import numpy as np
import pytest
import soundfile as sf
import torch
from konkani_texts import TEXTS
from torch.utils.data import DataLoader

from konkanivani.config import AugmentConfig, ConfigError
from konkanivani.data.audio import load_audio
from konkanivani.data.augment import (
    SPEED_FACTORS,
    Augmenter,
    batching_duration,
    reverberate,
    speed_perturb,
    utterance_generator,
    vtlp_warp_matrices,
)
from konkanivani.data.dataset import ASRDataset, collate, load_utterances
from konkanivani.data.features import LogMel
from konkanivani.data.frames import frames_of
from konkanivani.data.samplers import DurationBucketSampler, EpochKeyed, LengthGroupedBatchSampler
from konkanivani.datatools.corrupt import corrupt_manifest

ALL_ON = dict(speed_perturb=True, noise_prob=0.5, reverb_prob=0.5, vtlp_prob=0.5)
EACH = {
    "speed": dict(speed_perturb=True),
    "noise": dict(noise_prob=1.0),
    "reverb": dict(reverb_prob=1.0),
    "vtlp": dict(vtlp_prob=1.0),
}


def _wav(path, seconds, sr=16000, freq=220.0, seed=0):
    t = np.arange(int(seconds * sr)) / sr
    noise = np.random.default_rng(seed).normal(0, 0.01, len(t))
    sf.write(path, 0.3 * np.sin(2 * np.pi * freq * t) + noise, sr, subtype="PCM_16")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Six short utterances of different lengths and a manifest of them."""
    folder = tmp_path_factory.mktemp("aug")
    rows = []
    for i, seconds in enumerate((0.83, 1.0, 1.37, 0.61, 1.2, 0.95)):
        _wav(folder / f"u{i}.wav", seconds, freq=150 + 40 * i, seed=i)
        rows.append(
            {
                "audio_filepath": f"u{i}.wav",
                "duration": seconds,
                "text": TEXTS[i % 4],
                "speaker": f"s{i}",
            }
        )
    (folder / "m.jsonl").write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8"
    )
    return folder


@pytest.fixture(scope="module")
def utts(corpus, tokenizer):
    return load_utterances(corpus / "m.jsonl", tokenizer)[0]


_LOG_MEL = LogMel()


def _feats(example):
    """An example's features as the training step makes them (``LogMel.batch``, with its VTLP)."""
    vtlp = None if math.isnan(example.vtlp) else torch.tensor([example.vtlp])
    return _LOG_MEL.batch(example.audio[None], torch.tensor([len(example.audio)]), vtlp)[0][0]


def _dataset(utts, seed=3, **flags):
    return ASRDataset(utts, Augmenter(AugmentConfig(seed=seed, **flags)))


@pytest.mark.parametrize("name", EACH)
def test_frames_follow_the_augmented_waveform_and_tokens_stay(utts, name):
    dataset, plain = _dataset(utts, **EACH[name]), ASRDataset(utts)
    factors = set()
    for epoch in range(3):
        for index, utt in enumerate(utts):
            example = dataset[(epoch, index)]
            clean = load_audio(utt.audio_path)
            augmented = dataset.augment.waveform(clean, epoch, index)
            factor = dataset.augment.speed_factor(epoch, index)
            factors.add(factor)
            # speed scales it, the rest keep it
            assert len(augmented) == math.ceil(len(clean) / factor - 1e-9)
            assert torch.equal(example.audio, augmented)
            alpha = dataset.augment.vtlp_alpha(epoch, index)
            assert example.vtlp == alpha if alpha is not None else math.isnan(example.vtlp)
            assert _feats(example).shape == (1 + len(augmented) // 160, 80)
            assert torch.isfinite(_feats(example)).all()
            assert example.tokens.tolist() == utt.tokens == plain[index].tokens.tolist()
            assert example.index == index
    assert factors == (set(SPEED_FACTORS) if name == "speed" else {1.0})


def test_off_is_exactly_the_unaugmented_dataset(utts):
    plain = ASRDataset(utts)
    nothing = ASRDataset(utts, Augmenter(AugmentConfig(seed=3)))
    for index in range(len(utts)):
        assert torch.equal(_feats(plain[index]), _feats(nothing[(5, index)]))
        # a key without an augmenter: epoch unused
        assert torch.equal(_feats(plain[index]), _feats(plain[(5, index)]))


def test_same_key_same_features_whatever_the_instance_or_workers(utts):
    first, second = _dataset(utts, **ALL_ON), _dataset(utts, **ALL_ON)
    for key in [(0, 0), (1, 2), (7, 5)]:
        assert torch.equal(_feats(first[key]), _feats(second[key]))

    def epoch_batches(workers, epoch):
        sampler = LengthGroupedBatchSampler([u.duration for u in utts], batch_size=2, seed=1)
        sampler.set_epoch(epoch)
        loader = DataLoader(
            _dataset(utts, **ALL_ON),
            batch_sampler=EpochKeyed(sampler),
            collate_fn=collate,
            num_workers=workers,
        )
        return {
            i: feats[row, : int(frames[row])]
            for batch in loader
            for feats, frames in [batch.features(_LOG_MEL)]
            for row, i in enumerate(batch.indices)
        }

    in_process, in_a_worker = epoch_batches(0, 1), epoch_batches(1, 1)
    assert in_process.keys() == in_a_worker.keys() == set(range(len(utts)))
    # The same draws; the sums may round differently, as a worker computes on one thread.
    assert all(torch.allclose(in_process[i], in_a_worker[i], atol=1e-4) for i in in_process)
    assert all(torch.allclose(in_process[i], _feats(first[(1, i)]), atol=1e-4) for i in in_process)


def test_epochs_and_seeds_draw_differently(utts):
    dataset, other_seed = _dataset(utts, **ALL_ON), _dataset(utts, seed=4, **ALL_ON)
    differs = lambda a, b: a.shape != b.shape or not torch.equal(a, b)  # noqa: E731
    assert (
        sum(differs(_feats(dataset[(0, i)]), _feats(dataset[(1, i)])) for i in range(len(utts)))
        >= 4
    )
    assert (
        sum(differs(_feats(dataset[(0, i)]), _feats(other_seed[(0, i)])) for i in range(len(utts)))
        >= 4
    )
    # streams are independent: turning noise off leaves the speed draws as they were
    speed_only = _dataset(utts, speed_perturb=True).augment
    assert [speed_only.speed_factor(e, i) for e in range(4) for i in range(6)] == \
        [dataset.augment.speed_factor(e, i) for e in range(4) for i in range(6)]


def _snr_db(clean, noisy):
    return 10 * math.log10(float(clean.pow(2).sum() / (noisy - clean).pow(2).sum()))


def test_added_noise_has_the_drawn_snr_generated_or_from_a_folder(utts, tmp_path):
    (tmp_path / "noise").mkdir()
    _wav(tmp_path / "noise" / "short_8k.wav", 0.3, sr=8000, freq=1000.0)  # looped and resampled
    sf.write(
        tmp_path / "noise" / "long.flac", np.random.default_rng(1).normal(0, 0.2, 48000 * 3), 48000
    )
    (tmp_path / "noise" / "notes.txt").write_text("not audio")
    for noise_dir in ("", str(tmp_path / "noise")):
        augmenter = Augmenter(
            AugmentConfig(
                noise_prob=1.0,
                noise_snr_low_db=0.0,
                noise_snr_high_db=15.0,
                noise_dir=noise_dir,
                seed=2,
            )
        )
        assert len(augmenter.noise_files) == (2 if noise_dir else 0)
        drawn = []
        for index in range(12):
            clean = load_audio(utts[index % len(utts)].audio_path)
            noisy, snr = augmenter._noise(clean, utterance_generator(2, 0, index, "noise"))
            assert noisy.shape == clean.shape and torch.isfinite(noisy).all()
            assert abs(_snr_db(clean, noisy) - snr) < 0.5, (noise_dir, index)
            drawn.append(snr)
        assert 0.0 <= min(drawn) and max(drawn) <= 15.0 and max(drawn) - min(drawn) > 3


def test_a_folder_without_readable_audio_is_one_line(tmp_path):
    (tmp_path / "broken.wav").write_bytes(b"RIFF not a wav")
    (tmp_path / "readme.txt").write_text("x")
    with pytest.raises(ConfigError, match=f"--noise_dir {tmp_path}: no readable audio file in it"):
        Augmenter(AugmentConfig(noise_prob=0.5, noise_dir=str(tmp_path)))


def test_reverb_keeps_length_level_and_alignment(utts, tmp_path):
    clean = load_audio(utts[1].audio_path)
    augmenter = Augmenter(AugmentConfig(reverb_prob=1.0, seed=5))
    for index in range(4):
        wet = augmenter.waveform(clean, 0, index)
        assert wet.shape == clean.shape and torch.isfinite(wet).all()
        assert wet.pow(2).mean().sqrt() == pytest.approx(
            float(clean.pow(2).mean().sqrt()), rel=1e-4
        )
        assert not torch.equal(wet, clean)
    # An RIR file whose direct path comes 200 samples in: no delay in the output (a pure delayed
    # impulse gives back the input), and a decaying tail leaves it correlated with the input.
    rir = np.zeros(4000)
    rir[200] = 0.5
    sf.write(tmp_path / "delay.wav", rir, 16000, subtype="FLOAT")
    delayed = Augmenter(AugmentConfig(reverb_prob=1.0, rir_dir=str(tmp_path)))
    torch.testing.assert_close(delayed.waveform(clean, 0, 0), clean, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(reverberate(clean, torch.tensor([0.0, 0.0, 1.0])), clean)


def test_no_speed_up_leaves_an_utterance_too_short_for_ctc():
    augmenter = Augmenter(AugmentConfig(speed_perturb=True, seed=3))
    sped_up = next(i for i in range(100) if augmenter.speed_factor(0, i) == 1.1)
    wav = torch.randn(16000)  # 24 encoder frames (either front-end); 22 after a 1.1 speed-up
    assert len(augmenter.waveform(wav, 0, sped_up, min_encoder_frames=22)) < len(wav)
    assert torch.equal(augmenter.waveform(wav, 0, sped_up, min_encoder_frames=23), wav)


def test_vtlp_alpha_one_is_no_warp_and_alpha_moves_a_tone():
    log_mel = LogMel(80)
    t = torch.arange(16000) / 16000
    tone = torch.sin(2 * math.pi * 1000 * t)

    def warp(alpha: float) -> torch.Tensor:
        return vtlp_warp_matrices(torch.tensor([alpha]), log_mel.n_freqs)[0]

    torch.testing.assert_close(warp(1.0), torch.eye(log_mel.n_freqs))
    torch.testing.assert_close(log_mel(tone, warp(1.0)), log_mel(tone), atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(
        log_mel(tone, warp(1.0 + 1e-6)),
        log_mel(tone),
        atol=1e-3,
        rtol=1e-4,
    )
    spectrum = log_mel.mel.spectrogram(tone).mean(1)  # (F,), 40 Hz bins
    for alpha in (0.9, 1.1):
        warped = warp(alpha) @ spectrum
        assert int(warped.argmax()) * 40 == pytest.approx(1000 * alpha, abs=40)


def test_speed_perturbation_never_takes_a_batch_over_its_frame_budget():
    rng = np.random.default_rng(0)
    durations = list(rng.uniform(0.3, 4.0, 300).round(3))
    budget = 2000
    slowest = [
        1 + len(speed_perturb(torch.zeros(int(d * 16000)), min(SPEED_FACTORS))) // 160
        for d in durations
    ]
    planned = DurationBucketSampler([batching_duration(d, True) for d in durations], budget, seed=1)
    naive = DurationBucketSampler(durations, budget, seed=1)
    for epoch in range(3):
        planned.set_epoch(epoch)
        naive.set_epoch(epoch)
        batches = planned.epoch_batches()
        assert sorted(i for b in batches for i in b) == list(range(len(durations)))
        assert all(len(b) * max(slowest[i] for i in b) <= budget for b in batches)
        # without planning for the slowest, some batch would go over when its utterances are slowed
        assert any(len(b) * max(slowest[i] for i in b) > budget for b in naive.epoch_batches())
    assert all(frames_of(batching_duration(d, True)) >= f for d, f in zip(durations, slowest))
    assert batching_duration(2.5, False) == 2.5


def test_corrupt_manifest_is_a_deterministic_noisy_copy(corpus, tokenizer, tmp_path):
    first = corrupt_manifest(
        corpus / "m.jsonl", tmp_path / "a", "test_noisy", seed=7, snr_db=(5.0, 10.0)
    )
    again = corrupt_manifest(
        corpus / "m.jsonl", tmp_path / "b", "test_noisy", seed=7, snr_db=(5.0, 10.0)
    )
    other = corrupt_manifest(
        corpus / "m.jsonl", tmp_path / "c", "test_noisy", seed=8, snr_db=(5.0, 10.0)
    )
    assert first == tmp_path / "a" / "test_noisy.jsonl"
    src = [
        json.loads(line) for line in (corpus / "m.jsonl").read_text(encoding="utf-8").splitlines()
    ]
    rows = [json.loads(line) for line in first.read_text(encoding="utf-8").splitlines()]
    assert [r["text"] for r in rows] == [r["text"] for r in src]
    assert [r["speaker"] for r in rows] == [r["speaker"] for r in src]
    for row, source in zip(rows, src):
        assert not row["audio_filepath"].startswith("/")
        info = sf.info(str(first.parent / row["audio_filepath"]))
        assert (info.samplerate, info.subtype) == (16000, "PCM_16")
        assert row["duration"] == pytest.approx(source["duration"], abs=1e-3)
        clean, noisy = load_audio(corpus / source["audio_filepath"]), load_audio(
            first.parent / row["audio_filepath"]
        )
        # noise and reverberation both took the copy away from the original
        assert _snr_db(clean, noisy) < 12
        assert (first.parent / row["audio_filepath"]).read_bytes() == \
            (again.parent / row["audio_filepath"]).read_bytes()
    assert any(
        (first.parent / r["audio_filepath"]).read_bytes()
        != (other.parent / r["audio_filepath"]).read_bytes()
        for r in rows
    )
    assert len(load_utterances(first, tokenizer)[0]) == len(src)  # usable as a manifest as it is


def test_an_unbroken_and_a_resumed_augmented_run_see_the_same_batches(
    tiny_corpus, tmp_path, caplog
):
    """Every augmentation on: stopped mid-epoch at step 3 and resumed (with a worker process this
    time) to step 8, across an epoch boundary (5 steps an epoch), the losses are those of the
    unbroken run.
    """
    from tiny_args import tiny_args

    from konkanivani.checkpoint import load_checkpoint
    from konkanivani.cli import train as cli

    augment = [
        "--speed_perturb",
        "--noise_prob",
        "0.5",
        "--reverb_prob",
        "0.5",
        "--vtlp_prob",
        "0.5",
        "--max_batch_frames",
        "2400",
    ]
    whole, split = tmp_path / "whole", tmp_path / "split"
    with caplog.at_level(logging.INFO, logger="konkanivani"):
        assert cli.main(tiny_args(tiny_corpus, whole, *augment, "--max_steps", "8")) == 0
    assert (
        "augmentation of training utterances: speed perturbation x0.9/1/1.1; reverberation p=0.5 "
        "(synthetic rooms); noise p=0.5 at 5-20 dB SNR (generated noise); VTLP p=0.5"
        in caplog.text
    )
    assert cli.main(tiny_args(tiny_corpus, split, *augment, "--max_steps", "3")) == 0
    stopped = load_checkpoint(split / "latest.pt")
    assert stopped["step"] == 3 and stopped["batches_done"] > 0 and stopped["epoch"] == 0
    assert (
        cli.main(
            tiny_args(
                tiny_corpus,
                split,
                *augment,
                "--max_steps",
                "8",
                "--num_workers",
                "1",
                "--resume",
                "latest",
            )
        )
        == 0
    )

    def train_rows(out):
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [r for r in rows if r["kind"] == "train"]

    resumed, unbroken = train_rows(split), train_rows(whole)
    assert [r["step"] for r in resumed] == [r["step"] for r in unbroken] == list(range(1, 9))
    # the comparison crosses into a new epoch's draws
    assert unbroken[-1]["epoch"] > unbroken[0]["epoch"]
    for a, b in zip(resumed, unbroken, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (a, b)
