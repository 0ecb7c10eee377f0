"""Several training sets mixed by weight (``--train_mix``, issue 52): each epoch's share of every
set is its weight's, a set drawn less than its size shows the rest of itself in the next epochs,
the batches are a pure function of the seed and the epoch (a resumed epoch is the unbroken one's),
and a tiny model trained on two sets learns and resumes exactly."""
from __future__ import annotations

import json
import logging
import random
import re
from collections import Counter

import pytest
from tiny_args import tiny_args

from konkanivani.cli import train as cli
from konkanivani.config import ConfigError, parse_mix
from konkanivani.data.samplers import train_sampler

SIZES, WEIGHTS = (10, 50, 100), (1.0, 1.0, 2.0)
SOURCES = [k for k, n in enumerate(SIZES) for _ in range(n)]
DURATIONS = [1.0 + 4.0 * random.Random(i).random() for i in range(len(SOURCES))]


def _sampler(**kwargs):
    return train_sampler(DURATIONS, 4, kwargs.pop("max_frames", 0), 5, 10,
                         mix=(SOURCES, WEIGHTS), **kwargs)


@pytest.mark.parametrize("max_frames", [0, 1500])  # fixed batches, and batches under a budget
def test_each_epoch_holds_every_set_as_its_weight_says_and_is_seeded(max_frames):
    sampler, again = _sampler(max_frames=max_frames), _sampler(max_frames=max_frames)
    epochs = []
    for epoch in range(4):
        sampler.set_epoch(epoch)
        again.set_epoch(epoch)
        batches = sampler.epoch_batches()
        assert batches == again.epoch_batches()  # a pure function of the seed and the epoch
        counts = Counter(SOURCES[i] for batch in batches for i in batch)
        total = sum(counts.values())
        assert total == len(SOURCES)  # an epoch is as long as the sets together
        for k, weight in enumerate(WEIGHTS):
            assert abs(counts[k] / total - weight / sum(WEIGHTS)) <= 0.01, counts
        epochs.append(batches)
    assert epochs[0] != epochs[1]
    # the largest set (100, drawn 80 an epoch) shows all of itself within two epochs
    seen = {i for batches in epochs[:2] for batch in batches for i in batch if SOURCES[i] == 2}
    assert len(seen) == SIZES[2]
    # the smallest (10, drawn 40) is seen four times an epoch, each of its utterances alike
    shown = Counter(i for batch in epochs[0] for i in batch if SOURCES[i] == 0)
    assert set(shown.values()) == {4}


def test_an_epoch_resumed_mid_way_gives_the_rest_of_the_same_batches():
    unbroken = _sampler(curriculum_epochs=1)
    unbroken.set_epoch(2)
    resumed = _sampler(curriculum_epochs=1)
    resumed.set_epoch(2, start=7)
    assert list(resumed) == unbroken.epoch_batches()[7:]


@pytest.mark.parametrize("spec, message", [
    ("a.jsonl", "give two or more manifests"),
    ("a.jsonl:0:x,b.jsonl", "the weight must be a positive number"),
    ("fr/train.jsonl,ru/train.jsonl", "each its own name (got train, train)"),
    ("a.jsonl:1:x y,b.jsonl", "a name is letters"),
])
def test_a_bad_mix_is_one_line(spec, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_mix(spec)


@pytest.fixture(scope="module")
def two_sets(tiny_corpus, tmp_path_factory):
    """The tiny corpus's training rows in two manifests (absolute audio paths)."""
    folder = tmp_path_factory.mktemp("sets")
    rows = [json.loads(line) for line in (tiny_corpus / "train.jsonl").read_text().splitlines()]
    rows = [{**r, "audio_filepath": str(tiny_corpus / r["audio_filepath"])} for r in rows]
    for name, part in (("a", rows[::2]), ("b", rows[1::2])):
        (folder / f"{name}.jsonl").write_text(
            "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in part), encoding="utf-8")
    return folder


def _mix_args(tiny_corpus, sets, out, *extra):
    args = tiny_args(tiny_corpus, out, *extra)
    i = args.index("--train_manifest")
    mix = f"{sets / 'a.jsonl'}:1:a,{sets / 'b.jsonl'}:3:b"
    return [*args[:i], *args[i + 2:], "--train_mix", mix]


def _train_rows(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"]


@pytest.mark.slow
def test_a_model_trained_on_two_sets_by_weight_learns_and_resumes_exactly(tiny_corpus, two_sets,
                                                                        tmp_path, caplog):
    whole, split = tmp_path / "whole", tmp_path / "split"
    with caplog.at_level(logging.INFO, logger="konkanivani"):
        assert cli.main(_mix_args(tiny_corpus, two_sets, whole, "--max_steps", "30")) == 0
    draws = re.findall(r"epoch (\d+) draws: a (\d+) \(([\d.]+)%.*b (\d+) \(([\d.]+)%", caplog.text)
    assert len(draws) >= 3  # every epoch says what it draws
    for _, a, a_share, b, b_share in draws:
        assert abs(float(a_share) - 25.0) <= 1.0 and abs(float(b_share) - 75.0) <= 1.0
        assert int(a) + int(b) == 51
    rows = _train_rows(whole)
    assert sum(r["loss"] for r in rows[-5:]) < 0.9 * sum(r["loss"] for r in rows[:5])
    assert cli.main(_mix_args(tiny_corpus, two_sets, split, "--max_steps", "12")) == 0
    assert cli.main(_mix_args(tiny_corpus, two_sets, split, "--max_steps", "30",
                              "--resume", "latest")) == 0
    resumed = _train_rows(split)
    assert [r["step"] for r in resumed] == [r["step"] for r in rows] == list(range(1, 31))
    for a, b in zip(resumed, rows, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (a, b)


@pytest.mark.slow
def test_the_mix_takes_the_place_of_one_training_manifest(tiny_corpus, two_sets, tmp_path,
                                                        capsys, caplog):
    out = tmp_path / "run"
    args = [*_mix_args(tiny_corpus, two_sets, out), "--pseudo_manifest",
            str(tiny_corpus / "train.jsonl")]
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--train_mix takes the place of --train_manifest" in err[0], err
    # a recipe's --train_manifest gives way to the mix, as to --train_shards
    recipe = [*_mix_args(tiny_corpus, two_sets, out, "--max_steps", "1"), "--train_manifest",
              str(tiny_corpus / "train.jsonl")]
    with caplog.at_level(logging.INFO, logger="konkanivani"):
        assert cli.main(recipe) == 0
    assert f"--train_mix: --train_manifest {tiny_corpus / 'train.jsonl'} is not used" in caplog.text
    assert "epoch 1 draws: a 13" in caplog.text
    out = tmp_path / "other"
    missing = [*_mix_args(tiny_corpus, two_sets, out)]
    missing[-1] = missing[-1].replace("b.jsonl", "c.jsonl")
    assert cli.main(missing) == 2
    assert "c.jsonl: file not found" in capsys.readouterr().err
    assert not out.exists()
