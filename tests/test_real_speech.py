"""benchmarks/real_speech.py, the real-speech yardstick (issue 52), built from a small tree laid out
as Debian's packages unpack (Tux Paint's stamps, asterisk's prompts): phrases never in two splits,
Spanish in test alone, 16 kHz audio, the rows it cannot use counted, a second run reusing the
first's work."""
from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from benchmark_modules import load

real_speech = load("real_speech")

PHRASES = [f"phrase {word} spoken" for word in (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
    "oscar papa quebec romeo sierra tango").split()]


def _tone(seconds: float, rate: int, seed: int) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * (200 + 10 * seed) * t)).astype(np.float32)


def _tree(root: Path) -> None:
    """Twenty stamps, each described in fr and es (two stamps share a description, as Tux Paint's
    do), and five English prompts at 8 kHz; with a digit, a missing text, a placeholder recording
    and a description recorded far too short among them."""
    stamps = root / "usr" / "share" / "tuxpaint" / "stamps" / "animals"
    stamps.mkdir(parents=True)
    for i, phrase in enumerate(PHRASES):
        texts = {"fr": phrase.capitalize() + ".", "es": f"{phrase} en español"}
        if i == 1:
            texts["fr"] = "Phrase alpha spoken."  # the same phrase as stamp 0's: one split for both
        if i == 2:
            texts["fr"] = "A 25 cent piece."  # digits are read as words: dropped
        if i == 3:
            del texts["es"]  # recorded without its text: dropped
        (stamps / f"s{i}.txt").write_text(
            "Description.\n" + "".join(f"{k}.utf8={v}\n" for k, v in texts.items()),
            encoding="utf-8")
        for lang in ("fr", "es"):
            seconds = 0.2 if (i, lang) == (4, "fr") else 0.5 if (i, lang) == (5, "fr") else 1.6
            sf.write(stamps / f"s{i}_desc_{lang}.ogg", np.stack([_tone(seconds, 44100, i)] * 2, 1),
                     44100, format="OGG", subtype="VORBIS")
    doc = root / "usr" / "share" / "doc" / "asterisk-core-sounds-en"
    sounds = root / "usr" / "share" / "asterisk" / "sounds" / "en_US_f_Allison"
    doc.mkdir(parents=True)
    sounds.mkdir(parents=True)
    prompts = {f"prompt-{i}": f"Please hold, caller number {w}." for i, w in
               enumerate(["one", "two", "three", "four", "five"])}
    with gzip.open(doc / "core-sounds-en.txt.gz", "wt", encoding="utf-8") as f:
        f.write("; Core Asterisk Sounds in English\n\n")
        f.writelines(f"{k}: {v}\n" for k, v in prompts.items())
    for i, name in enumerate(prompts):
        sf.write(sounds / f"{name}.wav", _tone(1.5, 8000, i), 8000, subtype="PCM_16")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("packages")
    _tree(root)
    out = tmp_path_factory.mktemp("yardstick")
    summary = real_speech.build(out, root, seed=7, valid=0.2, test=0.2, min_phrases=5, jobs=1)
    return root, out, summary


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_each_phrase_is_in_one_split_and_spanish_in_test_alone(built):
    _, out, summary = built
    assert summary["languages"] == ["en", "es", "fr"]
    for lang in ("en", "fr"):
        texts = {s: {r["text"] for r in _rows(out / lang / f"{s}.jsonl")} for s in
                 real_speech.SPLITS}
        assert all(texts[s] for s in real_speech.SPLITS), texts
        assert not texts["train"] & texts["valid"] and not texts["train"] & texts["test"]
        assert not texts["valid"] & texts["test"]
    fr = [r for s in real_speech.SPLITS for r in _rows(out / "fr" / f"{s}.jsonl")]
    assert sum(r["text"] == "phrase alpha spoken" for r in fr) == 2  # both stamps, one split
    assert not _rows(out / "es" / "train.jsonl") and not _rows(out / "es" / "valid.jsonl")
    assert len(_rows(out / "es" / "test.jsonl")) == len(PHRASES) - 1
    for name in ("all_train.jsonl", "all_valid.jsonl"):
        assert {r["language"] for r in _rows(out / name)} == {"en", "fr"}  # never Spanish
    assert not (out / "es" / "train_15min.jsonl").exists()
    train = {r["audio_filepath"] for r in _rows(out / "fr" / "train.jsonl")}
    assert {r["audio_filepath"] for r in _rows(out / "fr" / "train_15min.jsonl")} == train


def test_audio_is_16_khz_mono_and_what_cannot_be_used_is_counted(built):
    _, out, summary = built
    for lang in summary["languages"]:
        for row in _rows(out / lang / "test.jsonl"):
            info = sf.info(out / lang / row["audio_filepath"])
            assert (info.samplerate, info.channels, info.format) == (16000, 1, "FLAC")
            assert abs(info.duration - row["duration"]) < 0.01
            assert row["text"] == row["text"].lower() and "." not in row["text"]
    assert summary["dropped"] == {
        "es: no text in its language": 1,
        "fr: audio shorter than 0.3 s or longer than 20.0 s": 1,
        "fr: text too long or short for its audio": 1,
        "fr: text with digits or symbols read as words": 1,
    }
    table = (out / "table.md").read_text(encoding="utf-8")
    assert "| es (evaluation only) | tuxpaint | 0 | 0.00 | 0 | 0.00 | 19 |" in table
    en = summary["table"]["en"]
    assert sum(en[s]["utterances"] for s in real_speech.SPLITS) == 5


def test_a_second_build_reuses_the_first_and_other_settings_rebuild(built, monkeypatch):
    root, out, summary = built
    manifests = {p: p.read_bytes() for p in sorted(out.rglob("*.jsonl"))}
    calls = Counter()
    monkeypatch.setattr(real_speech, "tuxpaint_recordings",
                        lambda *a: calls.update(["read"]) or [])
    assert real_speech.build(out, root, seed=7, valid=0.2, test=0.2, min_phrases=5,
                             jobs=1) == summary
    assert not calls and {p: p.read_bytes() for p in manifests} == manifests
    monkeypatch.undo()
    again = real_speech.build(out, root, seed=8, valid=0.2, test=0.2, min_phrases=5, jobs=1)
    assert again["settings"]["seed"] == 8
    assert sum(again["table"]["fr"][s]["utterances"] for s in real_speech.SPLITS) == sum(
        summary["table"]["fr"][s]["utterances"] for s in real_speech.SPLITS)


@pytest.mark.slow
def test_the_transfer_benchmark_trains_a_base_without_the_language_and_scores_all_three(
        built, tmp_path):
    root, yardstick, _ = built
    # seed 8's split (seed 7 puts "five" in English's valid split, letters its training phrases
    # lack, so the base would have no valid utterance); reused if the test before left it so
    real_speech.build(yardstick, root, seed=8, valid=0.2, test=0.2, min_phrases=5, jobs=1)
    transfer = load("real_speech_transfer")
    out = tmp_path / "transfer"
    assert transfer.training_languages(yardstick) == ["en", "fr"]  # never Spanish
    assert transfer.main(["--yardstick", str(yardstick), "--languages", "fr", "--base_steps", "2",
                          "--steps", "2", "--out", str(out), "--preset", "tiny",
                          "--batch_size", "2", "--num_workers", "0", "--noise_prob", "0"]) == 0
    base = out / "run" / "seed1234" / "base_without_fr"
    mixed = [json.loads(line) for line in (base / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in mixed) == 2
    config = (base / "config.yaml").read_text()  # (one language left: a manifest, not a mix)
    assert "data/en/train.jsonl" in config and "data/fr/" not in config
    table = (out / "table.md").read_text().splitlines()
    assert [line.split(" | ")[2] for line in table[2:]] == [
        "base (never heard it)", "from scratch", "fine-tuned from the base"]
    assert "| fr |" in (out / "summary.md").read_text()

    # --base_init: the base starts from a checkpoint (here French's own) instead of from scratch
    scratch = out / "run" / "seed1234" / "scratch_fr" / "best.pt"
    assert transfer.main(["--yardstick", str(yardstick), "--languages", "fr", "--base_steps", "2",
                          "--steps", "2", "--out", str(tmp_path / "from_init"), "--base_init",
                          str(scratch), "--preset", "tiny", "--batch_size", "2",
                          "--num_workers", "0", "--noise_prob", "0"]) == 0
    base = tmp_path / "from_init" / "run" / "seed1234" / "base_without_fr_from_init"
    assert f"init_from: {scratch}" in (base / "config.yaml").read_text()
    assert "--base_init" in (tmp_path / "from_init" / "summary.md").read_text()

    # --pretrain_steps: an encoder pretrained on every training language's audio (French's 15
    # minutes among them), French fine-tuned from it; --base_steps 0: no base
    assert transfer.main(["--yardstick", str(yardstick), "--languages", "fr", "--base_steps", "0",
                          "--steps", "2", "--pretrain_steps", "2", "--out",
                          str(tmp_path / "pretrained"), "--preset", "tiny", "--batch_size", "2",
                          "--num_workers", "0", "--noise_prob", "0"]) == 0
    run = tmp_path / "pretrained" / "run" / "seed1234"
    assert not (run / "base_without_fr").exists()
    config = (run / "pretrained" / "config.yaml").read_text()
    assert "pretrain: true" in config and "mask_prob: 0.02" in config
    assert "data/en/train.jsonl" in config and "data/fr/train.jsonl" in config
    assert f"init_from: {run / 'pretrained' / 'best.pt'}" in (
        run / "pretrained_fr" / "config.yaml").read_text()
    table = (tmp_path / "pretrained" / "table.md").read_text().splitlines()
    assert [line.split(" | ")[2] for line in table[2:]] == [
        "from scratch", "fine-tuned from the pretrained encoder"]
    assert "--pretrain_steps 2" in (tmp_path / "pretrained" / "summary.md").read_text()
