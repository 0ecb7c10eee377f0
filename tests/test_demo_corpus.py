import json
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf

from konkanivani.data.manifest import read_manifest
from konkanivani.data.tokenizer import normalize_text
from konkanivani.datatools.corpus import (
    FESTIVAL_SPEAKER,
    FESTIVAL_TRAIN_VOICES,
    HELDOUT,
    NOISY,
    festival_available,
    festival_train_voices,
    make_corpus,
    text_only_sentences,
)


def _rows(corpus, split):
    return [row for _, row in read_manifest(corpus / f"{split}.jsonl")]


def test_manifests_audio_and_held_out_test_split(tiny_corpus):
    rows = {s: _rows(tiny_corpus, s) for s in ("train", "valid", "test")}
    assert sum(map(len, rows.values())) == 64
    for split, split_rows in rows.items():
        assert split_rows, split
        for row in split_rows:
            info = sf.info(str(tiny_corpus / row["audio_filepath"]))
            assert info.samplerate == 16000 and info.channels == 1
            assert abs(info.frames / 16000 - row["duration"]) < 1e-3
            assert 0.5 < row["duration"] < 10 and row["text"].strip()
    seen = rows["train"] + rows["valid"]
    assert {r["text"] for r in seen}.isdisjoint(r["text"] for r in rows["test"])
    assert {r["speaker"] for r in seen}.isdisjoint(r["speaker"] for r in rows["test"])
    assert len({r["speaker"] for r in rows["train"]}) >= 6


def test_heldout_split_reads_the_test_sentences_with_a_voice_source_never_in_training(tiny_corpus):
    """.ci/run installs festival; without it the corpus has no heldout split."""
    if not festival_available():
        pytest.skip("festival and festvox-mr-nsk are not installed")
    heldout, test = _rows(tiny_corpus, HELDOUT), _rows(tiny_corpus, "test")
    assert len(heldout) == 2 * len({r["text"] for r in test})
    assert {r["text"] for r in heldout} == {r["text"] for r in test}
    assert {r["speaker"] for r in heldout} == {"festival:nsk"}
    assert not any(
        r["speaker"].startswith("festival")
        for s in ("train", "valid")
        for r in _rows(tiny_corpus, s)
    )
    for row in heldout:
        info = sf.info(str(tiny_corpus / row["audio_filepath"]))
        assert info.samplerate == 16000 and abs(info.frames / 16000 - row["duration"]) < 1e-3
        assert 0.5 < row["duration"] < 15


def test_noisy_test_split_is_the_test_split_in_a_room_with_noise(tiny_corpus):
    noisy, test = _rows(tiny_corpus, NOISY), _rows(tiny_corpus, "test")
    assert [r["text"] for r in noisy] == [r["text"] for r in test]
    for a, b in zip(noisy, test):
        clean, _ = sf.read(str(tiny_corpus / b["audio_filepath"]))
        dirty, rate = sf.read(str(tiny_corpus / a["audio_filepath"]))
        assert rate == 16000 and len(dirty) == len(clean)  # reverberation keeps the length
        snr = 10 * np.log10(np.sum(clean**2) / np.sum((dirty - clean) ** 2))
        assert snr < 25  # the clean files carry light noise of their own at 25-40 dB


def test_text_only_set_holds_no_sentence_of_the_speech_corpus(tiny_corpus, tmp_path):
    text = (tiny_corpus / "text.txt").read_text(encoding="utf-8").splitlines()
    assert len(text) > 100
    spoken = {
        normalize_text(r["text"]) for s in ("train", "valid", "test") for r in _rows(tiny_corpus, s)
    }
    assert spoken.isdisjoint(map(normalize_text, text))
    # A line equal to a speech sentence up to punctuation and spaces is dropped.
    own = tmp_path / "text.txt"
    own.write_text("हांव बरो आसां, देव बरें करूं।\nनवें वाक्य हांगा आसा\n", encoding="utf-8")
    assert text_only_sentences(own, ["हांव  बरो आसां देव बरें करूं"]) == ["नवें वाक्य हांगा आसा"]


def test_deterministic_for_a_seed_and_reused_when_present(tiny_corpus, tmp_path):
    again = make_corpus(
        tmp_path,
        seed=3,
        num_utterances=64,
        max_sentences=24,
        jobs=1,
        progress=False,
        festival_share=0,
    )
    assert not again["skipped"]
    for split in ("train", "valid", "test", NOISY, *([HELDOUT] if festival_available() else [])):
        assert (tmp_path / f"{split}.jsonl").read_bytes() == (
            tiny_corpus / f"{split}.jsonl"
        ).read_bytes()
    first = _rows(tmp_path, "train")[0]["audio_filepath"]
    assert (tmp_path / first).read_bytes() == (tiny_corpus / first).read_bytes()
    assert make_corpus(tmp_path, seed=3, num_utterances=64, max_sentences=24, progress=False,
                       festival_share=0)["skipped"]
    info = json.loads((tmp_path / "corpus_info.json").read_text())
    assert info["seed"] == 3


def test_parallel_synthesis_after_torch_has_run_in_this_process(tmp_path):
    """A process that has already run torch ops on two threads (a notebook, the test suite) can
    still
    make a corpus with two jobs: forked workers used to hang in their first resample."""
    script = (
        "import sys, torch\nfrom konkanivani.data.audio import resample\nfrom"
        " konkanivani.datatools.corpus import"
        " make_corpus\ntorch.set_num_threads(2)\nresample(torch.randn(200000), 22050, 16000)\nif"
        " __name__ == '__main__':\n    s = make_corpus(sys.argv[1], seed=5, num_utterances=8,"
        " max_sentences=8, jobs=2, progress=False,\n                    heldout=False,"
        " festival_share=0)\n    print(sum(s['splits'][k]['utterances'] for k in ('train', 'valid',"
        " 'test')))\n"
    )
    # The limit only turns a hang into a failure; the work itself takes a few seconds.
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["8"]


def test_text_sentences_read_into_training_leave_valid_and_test_as_they_were(tiny_corpus, tmp_path):
    """--train_from_text N: N text-only sentences join the training split's reading (same
    utterances,
    speakers and acoustics), leave text.txt, and change nothing in valid and test."""
    s = make_corpus(tmp_path, seed=3, num_utterances=64, max_sentences=24, jobs=2, progress=False,
                    heldout=False, train_from_text=20, festival_share=0)
    for split in ("valid", "test", NOISY):
        assert (tmp_path / f"{split}.jsonl").read_bytes() == (
            tiny_corpus / f"{split}.jsonl"
        ).read_bytes()
    before, after = _rows(tiny_corpus, "train"), _rows(tmp_path, "train")
    assert [(r["speaker"], r["speed"], r["pitch"]) for r in after] == \
           [(r["speaker"], r["speed"], r["pitch"]) for r in before]
    old_text = (tiny_corpus / "text.txt").read_text(encoding="utf-8").splitlines()
    new_text = (tmp_path / "text.txt").read_text(encoding="utf-8").splitlines()
    moved = set(old_text) - set(new_text)
    assert len(moved) == 20 and set(new_text) < set(old_text)
    trained = {r["text"] for r in after}
    # every sentence read at least once
    assert moved <= trained and {r["text"] for r in before} <= trained
    assert s["test_sentences_disjoint"] and s["text_disjoint"]
    assert json.loads((tmp_path / "corpus_info.json").read_text())["train_from_text"] == 20


def test_festival_voices_of_other_languages_read_a_share_of_training_and_nothing_else(
    tiny_corpus, tmp_path
):
    """--festival_share F: that share of the training utterances is read by festival's Czech,
    Finnish, Italian, Catalan and English voices instead of espeak-ng (same sentences); valid, test,
    test_noisy
    and heldout are byte for byte as they were, and the held-out NSK speaker stays out of training.
    """
    voices = festival_train_voices()
    if len(voices) < len(FESTIVAL_TRAIN_VOICES):
        pytest.skip(
            f"festival's training voices are not all installed ({len(voices)}):"
            " training_scripts/setup_env.sh"
        )
    s = make_corpus(
        tmp_path,
        seed=3,
        num_utterances=64,
        max_sentences=24,
        jobs=2,
        progress=False,
        festival_share=0.5,
    )
    for split in ("valid", "test", NOISY, *([HELDOUT] if festival_available() else [])):
        assert (tmp_path / f"{split}.jsonl").read_bytes() == (
            tiny_corpus / f"{split}.jsonl"
        ).read_bytes()
    before, after = _rows(tiny_corpus, "train"), _rows(tmp_path, "train")
    assert [r["text"] for r in after] == [r["text"] for r in before]
    read = [r for r in after if r["speaker"] in FESTIVAL_TRAIN_VOICES]
    assert len(read) == round(0.5 * len(after))
    # each voice reads some, in reshuffled passes
    assert {r["speaker"] for r in read} == set(voices)
    for r in read:
        audio, sr = sf.read(tmp_path / r["audio_filepath"])
        assert sr == 16000 and len(audio) / sr == pytest.approx(r["duration"], abs=1e-3)
        assert r["duration"] > 0.5 and np.abs(audio).max() > 0.5  # speech, peak-normalized
        voice = FESTIVAL_TRAIN_VOICES[r["speaker"]]
        assert (80 <= r["speed"] <= 130) if voice.stretches else r["speed"] == 100
        # F0 (Hz), or its own
        assert (85 <= r["pitch"] <= 150) if voice.language == "en" else r["pitch"] == 0
    assert not any(r["speaker"] == FESTIVAL_SPEAKER for r in after)
    assert (
        s["test_sentences_disjoint"]
        and s["test_speakers_disjoint"]
        and s.get("heldout_source_unseen", True)
    )
    info = json.loads((tmp_path / "corpus_info.json").read_text())
    assert info["festival_share"] == 0.5 and info["festival_voices"] == voices


def test_prosody_variety_gives_each_espeak_training_reading_its_own_range_and_gaps_only(
    tiny_corpus, tmp_path
):
    """--prosody_variety: every training utterance espeak-ng reads gets an intonation range and a
    pause between words of its own (same sentence, speaker, speed and pitch); valid, test,
    test_noisy and heldout are byte for byte as they were."""
    make_corpus(tmp_path, seed=3, num_utterances=64, max_sentences=24, jobs=2, progress=False,
                festival_share=0, prosody=True)
    for split in ("valid", "test", NOISY, *([HELDOUT] if festival_available() else [])):
        assert (tmp_path / f"{split}.jsonl").read_bytes() == (
            tiny_corpus / f"{split}.jsonl"
        ).read_bytes()
    before, after = _rows(tiny_corpus, "train"), _rows(tmp_path, "train")
    keys = ("text", "speaker", "speed", "pitch")
    assert [[r[k] for k in keys] for r in after] == [[r[k] for k in keys] for r in before]
    ranges, gaps = [r["pitch_range"] for r in after], [r["word_gap"] for r in after]
    assert all(30 <= v <= 200 for v in ranges) and len(set(ranges)) > 10
    assert all(0 <= v <= 4 for v in gaps) and len(set(gaps)) == 5
    # pauses between words make a reading longer than the same reading without them
    longer = [a["duration"] > b["duration"] for a, b in zip(after, before) if a["word_gap"] >= 3]
    assert longer and all(longer)
    info = json.loads((tmp_path / "corpus_info.json").read_text())
    assert info["prosody"] == {"pitch_range_percent": [30, 200], "word_gap": [0, 4]}
    assert "prosody" not in json.loads((tiny_corpus / "corpus_info.json").read_text())


def test_the_command_and_make_corpus_share_one_set_of_defaults(tmp_path, monkeypatch, capsys):
    """Without flags, DEFAULT_FESTIVAL_SHARE of training is read by festival's voices when all of
    them are installed (0 and the missing ones named when not: Debian's festival brings one English
    voice along, which would read the whole share), and DEFAULT_TRAIN_FROM_TEXT text sentences are
    read, none with --max_sentences or --sentences; flags win. The command leaves what it was not
    given to
    make_corpus, which takes default_options, the one home of these defaults."""
    from konkanivani.cli import demo_corpus as cli
    from konkanivani.datatools import corpus as demo_corpus
    resolved = []
    real_defaults = demo_corpus.default_options
    monkeypatch.setattr(
        demo_corpus,
        "default_options",
        lambda *a: resolved.append(real_defaults(*a)) or resolved[-1],
    )
    # make_corpus stops after its defaults
    monkeypatch.setattr(demo_corpus.shutil, "which", lambda name: None)
    calls = []
    monkeypatch.setattr(cli, "print_summary", lambda summary: None)

    def installed(voices):
        monkeypatch.setattr(demo_corpus, "festival_train_voices", lambda: voices)
        monkeypatch.setattr(cli, "festival_train_voices", lambda: voices)

    def run(*flags):
        real = demo_corpus.make_corpus
        monkeypatch.setattr(cli, "make_corpus", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
        # no espeak-ng (patched): after the defaults
        assert cli.main(["--output_dir", str(tmp_path), *flags]) == 2

    installed(list(FESTIVAL_TRAIN_VOICES))
    run()
    assert {k: calls[-1][k] for k in ("festival_share", "train_from_text")} == {
        "festival_share": None,
        "train_from_text": None,
    }
    assert (
        resolved[-1]
        == {
            "festival_share": demo_corpus.DEFAULT_FESTIVAL_SHARE,
            "train_from_text": demo_corpus.DEFAULT_TRAIN_FROM_TEXT,
        }
        == {"festival_share": 0.3, "train_from_text": 800}
    )
    run("--festival_share", "0.5", "--train_from_text", "0")
    assert {k: calls[-1][k] for k in ("festival_share", "train_from_text")} == {
        "festival_share": 0.5,
        "train_from_text": 0,
    }
    run("--max_sentences", "20")
    assert resolved[-1]["train_from_text"] == 0
    installed(["festival:en_kal"])
    capsys.readouterr()
    run()
    assert resolved[-1]["festival_share"] == 0.0
    out = capsys.readouterr().out
    assert (
        "festival's training voices missing: festival:ca_ona, festival:cs_dita" in out
        and "en_kal" not in out
    )


def test_a_sentence_festival_cannot_read_is_named_by_file_and_line_before_any_synthesis(tmp_path):
    """A Latin word or a digit in a sentence that a festival voice is to read: one error with the
    file and line, and no audio made (the voice would skip it and the audio would not say the
    transcript).
    """
    if not festival_train_voices():
        pytest.skip("festival's training voices are not installed")
    sentences = tmp_path / "sentences.txt"
    sentences.write_text("".join(f"वाक्य {i} नंबर\n" for i in range(12)), encoding="utf-8")
    with pytest.raises(ValueError, match=r"sentences.txt: line \d+: cannot transliterate '\d'"):
        make_corpus(
            tmp_path / "c",
            seed=1,
            num_utterances=20,
            jobs=1,
            progress=False,
            heldout=False,
            sentences_path=sentences,
            festival_share=1.0,
        )
    assert not any((tmp_path / "c").glob("wavs/*.wav"))
