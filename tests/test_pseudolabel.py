"""konkanivani-pseudolabel and training on its labels (issue 41): the confidence and the threshold
chosen on transcribed speech, a tiny teacher labelling tiny speech and a student trained on both, a
killed labelling run resumed without decoding again what it wrote, and the refusal of a
pseudo-labelled manifest where the truth is needed. The trainings are marked slow (tiny_corpus)."""
from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from tiny_args import tiny_args
from tone_speech import LETTERS, voiced_speech

from konkanivani.cli import evaluate, pseudolabel, train_lm
from konkanivani.cli import train as train_cli
from konkanivani.config import AugmentConfig
from konkanivani.data.augment import Augmenter
from konkanivani.data.dataset import ASRDataset, Utterance
from konkanivani.data.manifest import ManifestError
from konkanivani.datatools.shard_writer import write_shards
from konkanivani.decoding.alignment import Word
from konkanivani.decoding.confidence import Scored, choose_threshold, confidence_of, kept_cer
from konkanivani.decoding.evaluation import evaluate_manifest
from konkanivani.decoding.metrics import ErrorCounts
from konkanivani.decoding.recognizer import Recognizer
from konkanivani.decoding.settings import DecodingConfig
from konkanivani.training.metrics_log import read_metrics

STEPS = "30"  # teacher and student alike: a few dozen steps of the tiny preset


def _hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                    encoding="utf-8")
    return path


# ---- the confidence ---------------------------------------------------------------------------

def test_confidence_is_word_probability_times_agreement_with_greedy_ctc():
    words = [Word("नमस्कार", 0.0, 0.5, 0.9), Word("गोंय", 0.5, 0.9, 0.5)]
    agreed = confidence_of("नमस्कार गोंय", words, "नमस्कार गोंय", 2.0)
    assert (agreed.word_prob_mean, agreed.word_prob_min, agreed.agreement) == (0.7, 0.5, 1.0)
    assert agreed.value == 0.7 and agreed.chars_per_second == pytest.approx(12 / 2.0)
    differs = confidence_of("नमस्कार गोंय", words, "नमस्कार", 2.0)
    assert 0 < differs.agreement < 1 and differs.value < agreed.value
    # no words aligned: nothing vouches for the text; no text at all: nothing to keep
    assert confidence_of("नमस्कार", [], "नमस्कार", 1.0).value == 0.0
    assert confidence_of("", [], "", 1.0).value == 0.0


def test_the_threshold_kept_is_the_lowest_under_the_target_cer():
    def scored(confidence, errors):
        return Scored(confidence, ErrorCounts(10, errors, 0, 0))

    scored_set = [scored(0.9, 0), scored(0.8, 1), scored(0.5, 3), scored(0.2, 9)]
    assert kept_cer(scored_set, 0.5) == (3, pytest.approx(4 / 30))
    assert choose_threshold(scored_set, 0.15) == 0.5  # 13% over three, the most kept
    assert choose_threshold(scored_set, 0.05) == 0.8  # 5% over two
    assert choose_threshold(scored_set, 0.0) == 0.9
    assert choose_threshold([scored(0.9, 5)], 0.1) is None
    assert math.isnan(kept_cer(scored_set, 0.95)[1])


# ---- the noisy student's draws ----------------------------------------------------------------

def test_noise_on_pseudo_labelled_utterances_only_drawn_by_epoch_and_index(tmp_path):
    wav = 0.1 * torch.sin(torch.arange(16000) / 8.0)
    sf.write(tmp_path / "a.wav", wav.numpy(), 16000)
    utts = [Utterance(tmp_path / "a.wav", 1.0, "क", [5], "m:1"),
            Utterance(tmp_path / "a.wav", 1.0, "क", [5], "p:1", pseudo=True)]
    noisy = Augmenter(AugmentConfig(seed=3, noise_prob=1.0), streams="pseudo/")
    data = ASRDataset(utts, pseudo_augment=noisy)
    assert data.augments
    clean = data[(0, 0)].audio
    assert torch.allclose(clean, wav, atol=1e-4)  # a transcribed one: as read
    first = data[(0, 1)].audio
    assert not torch.allclose(first, wav, atol=1e-3)
    assert torch.equal(first, data[(0, 1)].audio)  # the same key draws the same: resume-exact
    assert not torch.equal(first, data[(1, 1)].audio)  # each epoch draws afresh
    # its streams are its own: the same draws under the plain names give other noise
    plain = ASRDataset(utts, pseudo_augment=Augmenter(AugmentConfig(seed=3, noise_prob=1.0)))
    assert not torch.equal(first, plain[(0, 1)].audio)


# ---- refusals ---------------------------------------------------------------------------------

@pytest.fixture
def sine_corpus(tmp_path):
    """Three transcribed utterances of tones, and a pseudo-labelled manifest of them."""
    folder = tmp_path / "sines"
    folder.mkdir()
    rows = []
    for i, text in enumerate(["क ख", "ग घ", "क ग"]):
        audio = 0.1 * np.sin(np.arange(16000) * (0.05 + 0.02 * i))
        sf.write(folder / f"{i}.wav", audio.astype(np.float32), 16000)
        rows.append({"audio_filepath": f"{i}.wav", "duration": 1.0, "text": text})
    _write(folder / "train.jsonl", rows)
    _write(folder / "valid.jsonl", rows[:2])
    _write(folder / "pseudo.jsonl", [{**r, "confidence": 0.9,
                                      "pseudo_label": {"teacher": "t.pt", "confidence": 0.9}}
                                     for r in rows])
    return folder


def test_a_pseudo_labelled_manifest_is_refused_as_validation_and_by_evaluate(sine_corpus,
                                                                               tmp_path, capsys):
    before = _hashes(sine_corpus)
    out = tmp_path / "run"
    args = tiny_args(sine_corpus, out, "--tokenizer_type", "char", "--max_steps", "1")
    args[args.index("--valid_manifest") + 1] = str(sine_corpus / "pseudo.jsonl")
    assert train_cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pseudo.jsonl:1 is pseudo-labelled" in err[0], err
    assert not out.exists()
    checkpoint = tmp_path / "model.pt"
    checkpoint.write_bytes(b"not read: the manifest is refused first")
    assert evaluate.main([str(checkpoint), str(sine_corpus / "pseudo.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is pseudo-labelled" in err[0], err
    assert _hashes(sine_corpus) == before


def test_the_threshold_needs_one_way_and_the_output_folder_no_input(sine_corpus, tmp_path,
                                                                      capsys):
    checkpoint = tmp_path / "model.pt"
    checkpoint.write_bytes(b"x")
    base = [str(checkpoint), str(sine_corpus / "train.jsonl")]
    with pytest.raises(SystemExit) as stop:
        pseudolabel.main([*base, "--output_dir", str(tmp_path / "out")])
    assert stop.value.code == 2
    assert "--threshold T or --choose_threshold_on" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        pseudolabel.main([*base, "--threshold", "0.5", "--output_dir", str(sine_corpus)])
    assert stop.value.code == 2 and "which this command reads" in capsys.readouterr().err
    assert pseudolabel.main([*base, "--choose_threshold_on", str(sine_corpus / "pseudo.jsonl"),
                             "--output_dir", str(tmp_path / "out")]) == 2
    assert "is pseudo-labelled" in capsys.readouterr().err


# ---- teacher, labels, student (slow) ----------------------------------------------------------

@pytest.fixture(scope="module")
def split(tiny_corpus, tmp_path_factory):
    """The tiny corpus's training set cut in two: the first half transcribed, the rest as a
    manifest without text (its true text kept aside)."""
    folder = tmp_path_factory.mktemp("split")
    rows = _rows(tiny_corpus / "train.jsonl")
    half = len(rows) // 2
    absolute = [{**r, "audio_filepath": str(tiny_corpus / r["audio_filepath"])} for r in rows]
    _write(folder / "labelled.jsonl", absolute[:half])
    _write(folder / "audio_only.jsonl", [{k: v for k, v in r.items() if k != "text"}
                                         for r in absolute[half:]])
    return folder


@pytest.fixture(scope="module")
def teacher(tiny_corpus, split, tmp_path_factory):
    out = tmp_path_factory.mktemp("teacher")
    args = tiny_args(tiny_corpus, out, "--tokenizer_type", "char", "--max_steps", STEPS,
                     "--batch_size", "4", "--gradient_accumulation_steps", "1")
    args[args.index("--train_manifest") + 1] = str(split / "labelled.jsonl")
    assert train_cli.main(args) == 0
    return out


def test_a_teacher_labels_audio_and_a_student_trains_on_both(tiny_corpus, split, teacher,
                                                             tmp_path, caplog):
    before = _hashes(tiny_corpus) | {f"split/{k}": v for k, v in _hashes(split).items()}
    out = tmp_path / "pseudo"
    code = pseudolabel.main([str(teacher / "latest.pt"), str(split / "audio_only.jsonl"),
                             "--choose_threshold_on", str(tiny_corpus / "valid.jsonl"),
                             "--target_label_cer", "1000", "--min_chars_per_second", "0",
                             "--method", "joint", "--batch_size", "4", "--jobs", "2",
                             "--output_dir", str(out)])
    assert code == 0
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    labels, kept = _rows(out / "labels.jsonl"), _rows(out / "pseudo.jsonl")
    assert len(labels) == len(_rows(split / "audio_only.jsonl")) == report["utterances"]
    assert report["kept"] == len(kept) > 0 and report["threshold"] is not None
    assert report["valid_utterances"] > 0 and report["threshold_chosen_on"]
    assert sum(report["dropped"].values()) + report["kept"] == report["utterances"]
    assert all(r["pseudo_label"]["teacher"] == str(teacher / "latest.pt") for r in kept)
    assert all(r["confidence"] >= report["threshold"] and r["text"] for r in kept)
    assert "| threshold | kept | hours |" in (out / "report.md").read_text(encoding="utf-8")

    student = tmp_path / "student"
    args = tiny_args(tiny_corpus, student, "--tokenizer", str(teacher / "tokenizer.model"),
                     "--max_steps", STEPS, "--batch_size", "4", "--gradient_accumulation_steps",
                     "1", "--pseudo_manifest", str(out / "pseudo.jsonl"), "--pseudo_weight", "1",
                     "--pseudo_noise_prob", "0.5")
    args[args.index("--train_manifest") + 1] = str(split / "labelled.jsonl")
    with caplog.at_level("INFO", logger="konkanivani"):
        assert train_cli.main(args) == 0
    assert f"{len(kept)} pseudo-labelled utterances an epoch" in caplog.text
    assert "augmentation of pseudo-labelled utterances (noisy student)" in caplog.text
    losses = [r["loss"] for r in read_metrics(student / "metrics.jsonl")["train"]]
    assert len(losses) >= 20 and sum(losses[-5:]) < 0.8 * sum(losses[:5]), losses
    # That a student beats its teacher: test_a_student_on_labels_decoded_with_a_language_model_...
    assert _hashes(tiny_corpus) | {f"split/{k}": v for k, v in _hashes(split).items()} == before


def _voiced_corpus(root: Path) -> None:
    """Tone speech of many speakers (``voiced_speech``) over a vocabulary of ten words: 16
    transcribed utterances of speakers alike (base pitch within 3%), 256 of audio alone and 24 to
    validate on of speakers up to 15% apart, and 3,000 sentences of text."""
    rng = random.Random(0)
    vocabulary: list[str] = []
    while len(vocabulary) < 10:
        word = rng.choice(LETTERS)
        while len(word) < rng.randint(2, 4):
            word += rng.choice([c for c in LETTERS if c != word[-1]])
        if word not in vocabulary:
            vocabulary.append(word)

    def sentence() -> str:
        return " ".join(rng.choice(vocabulary) for _ in range(rng.randint(1, 3)))

    def write(name: str, count: int, spread: float, seed0: int, text: bool = True) -> None:
        rows = []
        for i in range(count):
            said, path = sentence(), root / "wavs" / f"{name}_{i}.wav"
            path.parent.mkdir(parents=True, exist_ok=True)
            wav = voiced_speech(said, seed0 + i, spread)
            sf.write(path, wav.numpy(), 16000)
            rows.append({"audio_filepath": str(path), "duration": len(wav) / 16000}
                        | ({"text": said} if text else {}))
        _write(root / f"{name}.jsonl", rows)

    write("train", 16, 0.03, 0)
    write("audio_only", 256, 0.15, 1000, text=False)
    write("valid", 24, 0.15, 2000)
    (root / "text.txt").write_text("".join(sentence() + "\n" for _ in range(3000)),
                                   encoding="utf-8")


@pytest.mark.slow
def test_a_student_on_labels_decoded_with_a_language_model_beats_its_teacher(tmp_path):
    """Iterative pseudo-labelling's gain, in small: a teacher trained on 16 transcribed utterances
    of speakers alike stays near a third of the letters wrong on other speakers, however long it
    trains. It labels audio of many speakers with a language model of the text fused in its beam
    search, so the labels hold what the LM knows and the acoustic model alone does not; a student
    trained for as many steps on the transcribed part and those labels learns it from the audio,
    and its validation CER (greedy CTC, as the teacher's) is well below the teacher's."""
    root = tmp_path / "voiced"
    _voiced_corpus(root)
    steps = ["--tokenizer_type", "char", "--max_steps", "500", "--batch_size", "4",
             "--gradient_accumulation_steps", "1", "--keep_checkpoints", "1"]
    teacher, lm, out, student = (root / n for n in ("teacher", "lm", "pseudo", "student"))
    assert train_cli.main(tiny_args(root, teacher, *steps)) == 0
    assert train_lm.main([str(root / "text.txt"), "--tokenizer", str(teacher / "tokenizer.model"),
                          "--output_dir", str(lm), "--d_model", "64", "--layers", "2",
                          "--n_heads", "2", "--max_steps", "300", "--batch_size", "32"]) == 0
    assert pseudolabel.main([str(teacher / "latest.pt"), str(root / "audio_only.jsonl"),
                             "--choose_threshold_on", str(root / "valid.jsonl"),
                             "--target_label_cer", "30", "--min_chars_per_second", "0",
                             "--method", "beam", "--lm", str(lm / "best.pt"), "--lm_weight",
                             "0.5", "--batch_size", "8", "--output_dir", str(out)]) == 0
    kept = json.loads((out / "report.json").read_text(encoding="utf-8"))["kept"]
    assert kept >= 128
    assert train_cli.main(tiny_args(root, student, *steps[2:], "--tokenizer",
                                    str(teacher / "tokenizer.model"), "--pseudo_manifest",
                                    str(out / "pseudo.jsonl"), "--pseudo_noise_prob", "0.3")) == 0
    cer = {name: read_metrics(run / "metrics.jsonl")["valid"][-1]["cer"]
           for name, run in (("teacher", teacher), ("student", student))}
    assert cer["teacher"] > 0.2 and cer["student"] < cer["teacher"] - 0.04, cer


def test_a_killed_labelling_run_resumes_without_decoding_again(split, teacher, tmp_path,
                                                               monkeypatch):
    decode = Recognizer.decode_with_greedy
    decoded: list[int] = []
    kill_at = [6]

    def counting(self, wavs, *args, **kwargs):
        decoded.append(len(wavs))
        if len(decoded) == kill_at[0]:
            raise KeyboardInterrupt
        return decode(self, wavs, *args, **kwargs)

    monkeypatch.setattr(Recognizer, "decode_with_greedy", counting)
    out = tmp_path / "pseudo"
    argv = [str(teacher / "latest.pt"), str(split / "audio_only.jsonl"), "--threshold", "0",
            "--min_chars_per_second", "0", "--method", "greedy", "--batch_size", "1",
            "--output_dir", str(out)]
    assert pseudolabel.main(argv) == 130
    # a window is 4 batches of 1: the first was written whole, the second was cut by the kill
    written = (out / "labels.jsonl").read_bytes()
    assert len(written.splitlines()) == 4 and not (out / "pseudo.jsonl").exists()
    with open(out / "labels.jsonl", "ab") as f:  # a row cut off by a SIGKILL mid-write
        f.write(b'{"key": "/half')
    decoded.clear()
    kill_at[0] = -1
    assert pseudolabel.main(argv) == 0
    total = len(_rows(split / "audio_only.jsonl"))
    assert sum(decoded) == total - 4  # nothing written was decoded again
    labels = (out / "labels.jsonl").read_bytes()
    assert labels.startswith(written)
    keys = [r["key"] for r in _rows(out / "labels.jsonl")]
    assert len(keys) == len(set(keys)) == total
    # another teacher (or other settings) into the same folder: refused, nothing decoded
    decoded.clear()
    assert pseudolabel.main([*argv[:-2], "--beam_size", "3", "--method", "beam",
                             "--output_dir", str(out)]) == 2
    assert not decoded and (out / "labels.jsonl").read_bytes() == labels


def _label(teacher: Path, out: Path, *inputs: Path) -> list[str]:
    return [str(teacher / "latest.pt"), *map(str, inputs), "--threshold", "0",
            "--min_chars_per_second", "0", "--method", "greedy", "--output_dir", str(out)]


def test_a_second_labelling_run_is_refused_while_the_first_holds_the_folder(split, teacher,
                                                                            tmp_path, capsys):
    out, before = tmp_path / "pseudo", _hashes(split)
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys
            from konkanivani.training.run_files import hold_run_directory
            with hold_run_directory({str(out)!r}, "labelling run"):
                print("held", flush=True)
                sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert pseudolabel.main(_label(teacher, out, split / "audio_only.jsonl")) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "in use by another labelling run" in err[0], err
        assert f"pid {holder.pid}," in err[0]
        assert sorted(p.name for p in out.iterdir()) == [".lock"]  # nothing labelled
    finally:
        holder.kill()
        holder.wait()
    assert pseudolabel.main(_label(teacher, out, split / "audio_only.jsonl")) == 0
    keys = [r["key"] for r in _rows(out / "labels.jsonl")]
    assert len(keys) == len(set(keys)) == len(_rows(split / "audio_only.jsonl"))
    assert _hashes(split) == before  # the inputs as they were


def test_a_rerun_labels_what_it_is_given_now_and_forgets_inputs_that_are_gone(
        split, teacher, tmp_path, capsys, monkeypatch):
    audio = tmp_path / "audio"
    audio.mkdir()
    rows = _rows(split / "audio_only.jsonl")
    for r in rows[:5]:
        shutil.copy(r["audio_filepath"], audio)
    for name in ("bad_1.wav", "bad_2.wav"):
        (audio / name).write_bytes(b"RIFF, but no audio")
    out = tmp_path / "pseudo"
    assert pseudolabel.main(_label(teacher, out, audio)) == 1
    assert "2 utterances could not be labelled" in capsys.readouterr().err
    labels = _rows(out / "labels.jsonl")
    assert len(labels) == 5 and not any("error" in r for r in labels)  # failures tried again
    (audio / "bad_1.wav").unlink()
    (audio / "bad_2.wav").unlink()
    audio_before = _hashes(audio)
    decode, decoded = Recognizer.decode_with_greedy, []
    monkeypatch.setattr(Recognizer, "decode_with_greedy",
                        lambda self, wavs, *a, **k: decoded.append(len(wavs))
                        or decode(self, wavs, *a, **k))
    assert pseudolabel.main(_label(teacher, out, audio)) == 0
    assert not decoded and "could not be labelled" not in capsys.readouterr().err
    assert json.loads((out / "report.json").read_text())["dropped"]["unreadable or failed"] == 0
    # other inputs into the same folder: only they are labelled and kept
    given = [{**r, "audio_filepath": str(audio / Path(r["audio_filepath"]).name)}
             for r in rows[3:5]] + rows[5:8]  # two of the folder's files, three new ones
    subset = _write(tmp_path / "subset.jsonl", given)
    given_bytes = subset.read_bytes()
    assert pseudolabel.main(_label(teacher, out, subset)) == 0
    assert "now ['" in capsys.readouterr().err  # the change of inputs is said
    assert sum(decoded) == 3  # the two of the folder were labelled already
    assert json.loads((out / "report.json").read_text())["utterances"] == len(given)
    kept = {r["audio_filepath"] for r in _rows(out / "pseudo.jsonl")}
    assert kept <= {r["audio_filepath"] for r in given}
    keys = [r["key"] for r in _rows(out / "labels.jsonl")]
    assert len(keys) == len(set(keys)) == 8
    assert json.loads((out / "labelling.json").read_text())["inputs"] == [str(subset)]
    assert _hashes(audio) == audio_before and subset.read_bytes() == given_bytes


def test_a_doubled_labels_file_of_an_earlier_version_is_mended_and_its_rows_marked(
        split, teacher, tmp_path):
    out = tmp_path / "pseudo"
    argv = _label(teacher, out, split / "audio_only.jsonl")
    assert pseudolabel.main(argv) == 0
    labels = _rows(out / "labels.jsonl")
    assert all(r["pseudo_label"]["teacher"] == str(teacher / "latest.pt") for r in labels)
    # as two runs at once and an older version wrote it: every key twice, unmarked, an error row
    old = [{k: v for k, v in r.items() if k != "pseudo_label"} for r in labels]
    _write(out / "labels.jsonl", [*old, *old, {"key": old[0]["key"], "error": "was unreadable"}])
    assert pseudolabel.main(argv) == 0
    assert _rows(out / "labels.jsonl") == labels
    kept = [r["audio_filepath"] for r in _rows(out / "pseudo.jsonl")]
    assert len(kept) == len(set(kept))
    assert json.loads((out / "report.json").read_text())["utterances"] == len(labels)


def test_every_manifest_the_labeller_writes_is_refused_where_the_truth_is_needed(
        tiny_corpus, split, teacher, tmp_path, capsys):
    out = tmp_path / "pseudo"
    # (a teacher of a few steps may reach no target: its labels are written all the same)
    assert pseudolabel.main([str(teacher / "latest.pt"), str(split / "audio_only.jsonl"),
                             "--choose_threshold_on", str(tiny_corpus / "valid.jsonl"),
                             "--target_label_cer", "100", "--min_chars_per_second", "0",
                             "--method", "greedy", "--output_dir", str(out)]) in (0, 2)
    capsys.readouterr()
    for name in ("labels.jsonl", "valid_labels.jsonl"):  # pseudo.jsonl's: test_a_pseudo_labelled...
        before = _hashes(out)
        assert evaluate.main([str(teacher / "latest.pt"), str(out / name)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{name}:1 is pseudo-labelled" in err[0], err
        run = tmp_path / f"run_{name}"
        args = tiny_args(tiny_corpus, run, "--tokenizer_type", "char", "--max_steps", "1")
        args[args.index("--valid_manifest") + 1] = str(out / name)
        assert train_cli.main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{name}:1 is pseudo-labelled" in err[0], err
        assert not run.exists() and _hashes(out) == before
        with pytest.raises(ManifestError, match=f"{name}:1 is pseudo-labelled"):  # benchmarks'
            evaluate_manifest(pseudolabel.load_recognizer(teacher / "latest.pt",
                                                          DecodingConfig()), out / name)


def test_shards_are_labelled_their_audio_copied_for_the_manifest(split, teacher, tmp_path):
    shards = tmp_path / "shards"
    write_shards(_write(tmp_path / "truth.jsonl", _rows(split / "labelled.jsonl")[:6]), shards,
                 shard_size=4, progress=False)
    before = _hashes(shards)
    out = tmp_path / "pseudo"
    assert pseudolabel.main([str(teacher / "latest.pt"), "--shards", str(shards / "shards.json"),
                             "--threshold", "0", "--min_chars_per_second", "0", "--method",
                             "greedy", "--output_dir", str(out)]) == 0
    labels = _rows(out / "labels.jsonl")
    assert len(labels) == 6 and all(":" in r["key"] for r in labels)
    for row in _rows(out / "pseudo.jsonl"):
        info = sf.info(row["audio_filepath"])
        assert Path(row["audio_filepath"]).parent == (out / "audio").resolve()
        assert abs(info.frames / info.samplerate - row["duration"]) < 0.01
    assert _hashes(shards) == before


def test_labels_greedy_ctc_disagrees_with_are_dropped_and_counted(split, teacher, tmp_path):
    """--min_agreement drops the labels whose greedy CTC text is further from them than it lets,
    whatever their confidence, and the report counts them; the labels are not decoded again."""
    out = tmp_path / "pseudo"
    argv = [str(teacher / "latest.pt"), str(split / "audio_only.jsonl"), "--threshold", "0",
            "--min_chars_per_second", "0", "--method", "joint", "--batch_size", "4",
            "--output_dir", str(out)]
    assert pseudolabel.main(argv) == 0
    everything = json.loads((out / "report.json").read_text(encoding="utf-8"))
    # the tiny teacher's greedy CTC text agrees with none of its joint labels; give every other
    # row an agreement above the cut in the labels file the rerun reads (it decodes nothing again)
    labels = _rows(out / "labels.jsonl")
    for i, row in enumerate(labels):
        row["agreement"] = 0.75 if i % 2 else 0.25
    (out / "labels.jsonl").write_text("".join(json.dumps(r) + "\n" for r in labels),
                                      encoding="utf-8")
    assert pseudolabel.main([*argv, "--min_agreement", "0.5"]) == 0
    assert _rows(out / "labels.jsonl") == labels  # nothing decoded again
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    kept = _rows(out / "pseudo.jsonl")
    by_path = {r["audio_filepath"]: r for r in labels}
    assert kept and all(by_path[r["audio_filepath"]]["agreement"] == 0.75 for r in kept)
    dropped = report["dropped"]["greedy CTC disagrees (--min_agreement)"]
    assert dropped > 0 and report["kept"] + dropped == everything["kept"]
    with pytest.raises(SystemExit) as bad:
        pseudolabel.main([*argv, "--min_agreement", "1.5"])
    assert bad.value.code == 2


def test_rounds_train_a_student_make_it_the_teacher_and_keep_a_table(tiny_corpus, split, teacher,
                                                                     tmp_path, monkeypatch):
    out = tmp_path / "rounds"
    argv = [str(teacher / "latest.pt"), str(split / "audio_only.jsonl"), "--rounds", "2",
            "--keep_pool", "--train_manifest", str(split / "labelled.jsonl"),
            "--valid_manifest", str(tiny_corpus / "valid.jsonl"), "--threshold", "0",
            "--min_chars_per_second", "0", "--method", "greedy", "--output_dir", str(out),
            "--train_flags", f"--tokenizer {teacher / 'tokenizer.model'} --preset tiny "
            "--batch_size 4 --lr 2e-3 --warmup_steps 8 --max_steps 12 --epochs 100 --num_workers 0 "
            "--no_progress --seed 5"]
    assert pseudolabel.main(argv) == 0
    table = json.loads((out / "rounds.json").read_text(encoding="utf-8"))
    assert [r["round"] for r in table] == [0, 1, 2]
    assert all(0 <= r["valid_cer"] for r in table)
    assert table[1]["teacher"] == str(teacher / "latest.pt")
    assert table[2]["teacher"] == str(out / "round_1" / "student" / "best.pt")
    assert table[2]["kept"] == len(_rows(out / "round_2" / "pseudo.jsonl"))
    # --keep_pool: round 2's student trained on both rounds' labels, each utterance once, with
    # its latest label
    kept = [{r["audio_filepath"]: r for r in _rows(out / f"round_{k}" / "pseudo.jsonl")}
            for k in (1, 2)]
    pool = {r["audio_filepath"]: r for r in _rows(out / "round_2" / "pool.jsonl")}
    assert pool == {**kept[0], **kept[1]} and table[2]["trained_on"] == len(pool)
    assert table[1]["trained_on"] == table[1]["kept"]
    assert (out / "round_2" / "student" / "best.pt").is_file()
    assert "| 2 |" in (out / "rounds.md").read_text(encoding="utf-8")
    # started again: every round is done, nothing is decoded or trained again
    calls = []
    monkeypatch.setattr(pseudolabel.train_cli, "main", lambda argv: calls.append(argv) or 0)
    monkeypatch.setattr(Recognizer, "decode_with_greedy", lambda *a, **k: calls.append(a))
    assert pseudolabel.main(argv) == 0 and not calls


def test_the_kept_pool_holds_every_round_and_each_utterances_latest_label(tmp_path):
    def row(name, text):
        return {"audio_filepath": str(tmp_path / f"{name}.wav"), "duration": 1.0, "text": text}

    for r in (1, 2):
        (tmp_path / f"round_{r}").mkdir()
    _write(tmp_path / "round_1" / "pseudo.jsonl", [row("a", "one"), row("b", "one")])
    _write(tmp_path / "round_2" / "pseudo.jsonl", [row("b", "two"), row("c", "two")])
    pool = pseudolabel._write_pool(tmp_path, 2)
    assert pool == tmp_path / "round_2" / "pool.jsonl"
    assert {Path(r["audio_filepath"]).stem: r["text"] for r in _rows(pool)} == {
        "a": "one", "b": "two", "c": "two"}
