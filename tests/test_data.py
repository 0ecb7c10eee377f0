import json
import logging
import math

import numpy as np
import pytest
import soundfile as sf
import torch
from konkani_texts import TEXTS

from konkanivani.data.dataset import ASRDataset, Unreadable, collate, load_utterances
from konkanivani.data.features import KaldiFbank, LogMel
from konkanivani.data.frames import ctc_frames_of, frames_of, subsampled_lengths
from konkanivani.data.manifest import ManifestError, check_row, check_text, read_manifest
from konkanivani.data.samplers import LengthGroupedBatchSampler, ShardedSampler
from konkanivani.data.tokenizer import train_tokenizer


def _wav(path, seconds=1.0, sr=16000):
    t = np.arange(int(seconds * sr)) / sr
    sf.write(path, 0.3 * np.sin(2 * np.pi * 220 * t), sr)
    return path


def _manifest(path, rows):
    path.write_text(
        "".join(
            (r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in rows
        ),
        encoding="utf-8",
    )
    return path


def test_bad_rows_are_skipped_named_and_counted(tmp_path, tokenizer, caplog):
    _wav(tmp_path / "good.wav")
    (tmp_path / "corrupt.wav").write_bytes(b"RIFF\x00\x00not really a wav file")
    _wav(tmp_path / "short.wav", seconds=0.05)
    manifest = _manifest(tmp_path / "m.jsonl", [
        {"audio_filepath": "good.wav", "duration": 1.0, "text": TEXTS[0]},
        {"audio_filepath": "missing.wav", "duration": 1.0, "text": TEXTS[1]},
        {"audio_filepath": "corrupt.wav", "duration": 1.0, "text": TEXTS[1]},
        {"audio_filepath": "good.wav", "duration": 1.0, "text": "   "},
        {"audio_filepath": "good.wav", "duration": 1.0, "text": "।।, ?"},
        {"audio_filepath": "short.wav", "duration": 0.05, "text": TEXTS[2]},
        "",
        {"audio_filepath": str(tmp_path / "good.wav"), "text": TEXTS[3], "speaker": "x"},
    ])
    with caplog.at_level(logging.WARNING, logger="konkanivani"):
        utts, skipped = load_utterances(manifest, tokenizer)
    assert [u.where for u in utts] == [f"{manifest}:1", f"{manifest}:8"]
    assert abs(utts[1].duration - 1.0) < 1e-6  # measured from the file when the row has none
    assert skipped == {"audio file missing": 1, "audio unreadable": 1, "empty text": 1,
                       "no token after normalization": 1, "too short for CTC": 1}
    for line in (2, 3, 4, 5, 6):
        assert f"{manifest}:{line}" in caplog.text


def test_the_ctc_check_counts_the_fewest_frames_of_either_front_end_and_a_blank_per_repeat():
    """0.9 s: LogMel makes 91 feature frames (22 encoder frames), KaldiFbank 90 (21). A text CTC
    cannot align with the Kaldi front-end, or whose repeated tokens need blanks the audio has no
    frames for, is "too short for CTC" whatever the model's front-end."""
    seconds, samples = 0.9, 14400
    assert len(LogMel()(torch.zeros(samples))) == frames_of(seconds) == 91
    assert len(KaldiFbank()(torch.zeros(samples))) == 90
    assert (subsampled_lengths(91), subsampled_lengths(90), ctc_frames_of(seconds)) == (22, 21, 21)
    chars = train_tokenizer(["abcdefghijklmnopqrstuvwxyz"], model_type="char")
    fits = "abcdefghijklmnopqrst"  # a word piece and 20 letters: 21 tokens, no two alike
    error, tokens = check_text(fits, seconds, chars)
    assert (error, len(tokens)) == (None, 21)
    assert check_text(fits + "u", seconds, chars) == (
        ("too short for CTC", "0.90 s for 22 tokens"), [])  # 22 frames for LogMel, 21 for Kaldi
    assert check_text("a" + fits[:-1], seconds, chars) == (
        ("too short for CTC", "0.90 s for 21 tokens and 1 repeated"), [])


def test_missing_manifest_and_non_json_lines_are_clear_errors(tmp_path):
    with pytest.raises(ManifestError, match="does not exist"):
        read_manifest(tmp_path / "nope.jsonl")
    bad = _manifest(
        tmp_path / "bad.jsonl", [{"audio_filepath": "a.wav", "text": "x"}, "audio_filepath,text"]
    )
    with pytest.raises(ManifestError, match=rf"{bad}:2: not a JSON line"):
        read_manifest(bad)
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    with pytest.raises(ManifestError, match="latin1.jsonl:1"):
        read_manifest(tmp_path / "latin1.jsonl")
    (tmp_path / "bom.jsonl").write_bytes(
        '\ufeff{"audio_filepath": "a.wav", "text": "x"}\n'.encode()
    )
    assert read_manifest(tmp_path / "bom.jsonl") == [(1, {"audio_filepath": "a.wav", "text": "x"})]
    _manifest(tmp_path / "list.jsonl", ["[1, 2]"])
    with pytest.raises(ManifestError, match="expected a JSON object"):
        read_manifest(tmp_path / "list.jsonl")


def test_dataset_features_and_collate(tmp_path, tokenizer):
    # the first text's 12 tokens need 0.6 s (ctc_frames_of: 14 encoder frames; 0.5 s makes 11)
    rows = [{"audio_filepath": _wav(tmp_path / f"{i}.wav", seconds=s).name, "text": t}
            for i, (s, t) in enumerate(zip((0.6, 1.0, 1.5, 2.0), TEXTS))]
    utts, skipped = load_utterances(_manifest(tmp_path / "m.jsonl", rows), tokenizer)
    ds = ASRDataset(utts)
    assert not skipped and len(ds) == 4
    ex = ds[1]
    # the waveform: the step makes its features
    assert ex.audio.shape == (16000,) and math.isnan(ex.vtlp)
    assert ex.tokens.tolist() == tokenizer.encode(TEXTS[1])
    # a file that failed to load is left out, and named
    batch = collate([ds[0], Unreadable(2), ds[3]])
    assert batch.audio.shape == (2, 32000) and batch.audio_lens.tolist() == [9600, 32000]
    feats, frames = batch.features(LogMel())
    assert feats.shape == (2, 1 + 32000 // 160, 80) and torch.isfinite(feats).all()
    assert frames.tolist() == batch.feat_lens.tolist() == [1 + 9600 // 160, 1 + 32000 // 160]
    assert batch.indices == [0, 3] and batch.missing == (2,)
    assert (batch.tokens[0, batch.token_lens[0]:] == -1).all()
    empty = collate([Unreadable(1)])
    assert len(empty) == 0 and empty.missing == (1,)


def test_unreadable_file_mid_epoch_is_named_not_raised(tmp_path, tokenizer, caplog):
    rows = [{"audio_filepath": _wav(tmp_path / "a.wav").name, "text": TEXTS[0]}]
    utts, _ = load_utterances(_manifest(tmp_path / "m.jsonl", rows), tokenizer)
    (tmp_path / "a.wav").write_bytes(b"garbage")  # corrupted after the manifest was checked
    with caplog.at_level(logging.WARNING, logger="konkanivani"):
        assert ASRDataset(utts)[0] == Unreadable(0)
    assert "m.jsonl:1" in caplog.text


def test_sampler_groups_by_length_is_seeded_and_resumes():
    durations = [float(d) for d in np.random.default_rng(0).uniform(1, 10, 103)]
    sampler = LengthGroupedBatchSampler(durations, batch_size=4, seed=7, pool_batches=5)
    sampler.set_epoch(2)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 26
    assert sorted(i for b in batches for i in b) == list(range(103))
    # similar lengths share a batch: far less spread than random batches would have
    spread = np.mean([max(durations[i] for i in b) - min(durations[i] for i in b) for b in batches])
    assert spread < 2.0
    again = LengthGroupedBatchSampler(durations, batch_size=4, seed=7, pool_batches=5)
    again.set_epoch(2)
    assert list(again) == batches
    again.set_epoch(3)
    assert list(again) != batches
    resumed = LengthGroupedBatchSampler(durations, batch_size=4, seed=7, pool_batches=5)
    resumed.load_state_dict({"epoch": 2, "start": 10})
    assert len(resumed) == 16
    assert list(resumed) == batches[10:]


def test_sharded_samplers_split_the_epoch_disjointly_in_equal_counts():
    durations = [float(d) for d in np.random.default_rng(1).uniform(1, 10, 103)]
    whole = LengthGroupedBatchSampler(durations, batch_size=4, seed=7)
    whole.set_epoch(3)
    everything = whole.epoch_batches()  # 26 batches: 2 shards of 13, 3 of 8 (2 dropped)
    for world in (2, 3):
        shards = [
            ShardedSampler(LengthGroupedBatchSampler(durations, batch_size=4, seed=7), r, world)
            for r in range(world)
        ]
        for s in shards:
            s.set_epoch(3)
        got = [list(s) for s in shards]
        assert len({len(g) for g in got}) == 1 and len(got[0]) == len(everything) // world
        flat = [tuple(b) for g in got for b in g]
        assert len(set(flat)) == len(flat) and set(flat) <= {tuple(b) for b in everything}
        # Batch k of every shard comes from the same stretch of the global order: one optimizer
        # step of the data-parallel run trains on what one process would train on in a row.
        assert [got[r][k] for k in range(len(got[0])) for r in range(world)] == everything[
            : len(flat)
        ]
        shards[0].set_epoch(3, start=5)  # a mid-epoch resume skips this shard's first batches
        assert list(shards[0]) == got[0][5:] and len(shards[0]) == len(got[0]) - 5


def test_validation_sampler_is_sorted_and_unshuffled():
    sampler = LengthGroupedBatchSampler([3.0, 1.0, 2.0, 5.0, 4.0], batch_size=2, shuffle=False)
    assert list(sampler) == [[1, 2], [0, 4], [3]]


def test_row_checks_duration_unknown_characters_and_strict_audio(tmp_path, tokenizer):
    _wav(tmp_path / "a.wav", seconds=1.0)
    t = np.arange(8000) / 8000
    sf.write(tmp_path / "b.wav", np.stack([np.sin(t * 900), np.cos(t * 900)], axis=1) * 0.3, 8000)

    def check(text=TEXTS[0], audio="a.wav", **kwargs):
        row = {
            "audio_filepath": audio,
            "text": text,
            **{k: v for k, v in kwargs.items() if k == "duration"},
        }
        return check_row(
            row, tmp_path, tokenizer, **{k: v for k, v in kwargs.items() if k != "duration"}
        )

    good = check(duration=1.2)
    assert good.error is None and good.duration == 1.0 and good.tokens == tokenizer.encode(TEXTS[0])
    assert check(duration=1.6).error[0] == "duration mismatch"
    assert check(duration=1.6, duration_tolerance=-1).error is None
    assert check(duration="1.0").error == ("duration not a number", "'1.0'")
    # json reads NaN and Infinity: the row is skipped and counted as the others
    for bad in (float("nan"), float("inf")):
        assert check(duration=bad).error == ("duration not a number", repr(bad))
    assert check(text="हांव ø घरा").error == (
        "characters the tokenizer cannot encode",
        "'ø' U+00F8",
    )
    converted = check(audio="b.wav")
    assert converted.error is None and converted.duration == 1.0
    assert [reason for reason, _ in converted.warnings] == ["not 16 kHz", "not mono"]
    assert check(audio="b.wav", strict=True).error[0] == "not 16 kHz"
