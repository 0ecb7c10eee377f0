"""benchmarks/pseudo_labels.py's bookkeeping: the kept pool across rounds, a labelling variant's
row (labels, no student) beside the trained stages, and '{lm}' in the labelling flags."""
import json
import subprocess
from pathlib import Path

import pytest
from benchmark_modules import load

pseudo_labels = load("pseudo_labels")


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                    encoding="utf-8")


def _stage(path: Path, cer: float) -> Path:
    """A trained stage's folder: its final.csv, every split greedy and joint."""
    path.mkdir(parents=True)
    lines = ["weights,split,method,cer,wer,rtf"] + [
        f"final (EMA),{split},{method},{cer:.2f},0,0"
        for split in pseudo_labels.SPLITS for method in ("greedy", "joint")]
    (path / "final.csv").write_text("\n".join(lines) + "\n")
    return path


def _labels(path: Path, rows: list[dict], threshold: float) -> Path:
    _write(path / "pseudo.jsonl", rows)
    (path / "report.json").write_text(json.dumps(
        {"kept": len(rows), "utterances": 4, "threshold": threshold}))
    return path


def test_the_pool_holds_every_round_each_utterance_with_its_latest_label(tmp_path):
    args = pseudo_labels.parse_args(["--out", str(tmp_path), "--keep_pool"])
    _write(tmp_path / "labels_1" / "pseudo.jsonl",
           [{"audio_filepath": "a.wav", "text": "old a"}, {"audio_filepath": "b.wav", "text": "b"}])
    _write(tmp_path / "labels_2" / "pseudo.jsonl",
           [{"audio_filepath": "a.wav", "text": "new a"}, {"audio_filepath": "c.wav", "text": "c"}])
    pool = pseudo_labels.pool(args, 2)
    rows = {r["audio_filepath"]: r["text"] for r in pseudo_labels._rows(pool)}
    assert rows == {"a.wav": "new a", "b.wav": "b", "c.wav": "c"}
    assert pool == tmp_path / "labels_2" / "pool.jsonl"
    assert pseudo_labels._rows(tmp_path / "labels_1" / "pseudo.jsonl")[0]["text"] == "old a"


def test_a_labelling_variants_row_has_its_labels_and_no_student(tmp_path):
    corpus = tmp_path / "corpus"
    _write(corpus / "train.jsonl", [{"audio_filepath": f"{n}.wav", "duration": 1.0, "text": t}
                                    for n, t in (("a", "abcd।"), ("b", "efgh"))])
    args = pseudo_labels.parse_args(["--out", str(tmp_path / "out"), "--corpus", str(corpus)])
    wav = str((corpus / "a.wav").resolve())
    stages = [
        {"stage": "teacher", "dir": _stage(tmp_path / "teacher", 30.0)},
        {"stage": "labels_1_lm", "labels": _labels(tmp_path / "lm", [
            {"audio_filepath": wav, "text": "abce"}], 0.25), "real_time": 40.0},
        {"stage": "round_2", "dir": _stage(tmp_path / "round_2", 20.0), "pool": 2,
         "labels": _labels(tmp_path / "l2", [{"audio_filepath": wav, "text": "abcd"}], 0.5)},
        {"stage": "full", "dir": _stage(tmp_path / "full", 10.0)},
    ]
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")
            for line in pseudo_labels.table(args, stages).splitlines() if line.startswith("| ")}
    variant = rows["labels_1_lm"]
    assert variant[1:6] == ["", "", "", "", ""]  # no student: no CER, no gap
    # one character in four wrong: the transcript's danda is not counted, as evaluation counts
    assert variant[6:9] == ["1 of 4", "0.250", "25.00"]
    assert rows["round_2"][5:9] == ["50%", "1 of 4; pool 2", "0.500", "0.00"]  # half the gap


def test_lm_in_the_labelling_flags_is_the_trained_lms_path(tmp_path, monkeypatch):
    args = pseudo_labels.parse_args(["--out", str(tmp_path), "--label_flags", "--lm {lm}"])
    args.lm_path = tmp_path / "lm" / "best.pt"
    audio = tmp_path / "audio.jsonl"
    _write(audio, [{"audio_filepath": "a.wav", "duration": 2.0}])
    commands = []

    def call(cmd, **kwargs):
        commands.append(cmd)
        (tmp_path / "labels" / "pseudo.jsonl").write_text("")
        return 0

    monkeypatch.setattr(subprocess, "call", call)
    pseudo_labels.label(args, tmp_path / "teacher" / "run" / "latest.pt", audio,
                        tmp_path / "labels", "--jobs 2 --lm {lm} --min_agreement 0.8")
    assert commands[0][-6:] == ["--jobs", "2", "--lm", str(args.lm_path), "--min_agreement",
                                "0.8"]


def test_a_student_is_asked_of_a_labelling_variant_that_exists(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        pseudo_labels.parse_args(["--out", str(tmp_path), "--label_variant", "lm=--lm {lm}",
                                  "--variant_student", "plain"])
    assert exit_info.value.code == 2
    assert "--variant_student plain: no such --label_variant" in capsys.readouterr().err
    args = pseudo_labels.parse_args(["--out", str(tmp_path), "--label_variant", "plain=",
                                     "--variant_student", "plain"])
    assert args.variant_student == ["plain"]


def test_a_variant_labels_with_the_weights_asked_and_a_student_variant_gets_the_teacher(
        tmp_path, monkeypatch):
    args = pseudo_labels.parse_args([
        "--out", str(tmp_path), "--rounds", "1", "--full", str(tmp_path / "full"),
        "--label_variant", "ema=", "--label_variant", "training=",
        "--variant_weights", "training=latest_training_weights.pt",
        "--student_variant", "warm=--init_from {teacher} --max_steps 9"])
    labelled, audio = tmp_path / "labelled.jsonl", tmp_path / "audio.jsonl"
    monkeypatch.setattr(pseudo_labels, "split_corpus", lambda *a: (labelled, audio))
    labelled_by, trained = {}, {}

    def label(args, teacher, audio, out, flags=None):
        labelled_by[out.name] = teacher
        return {"real_time": 1.0}

    def run_one(la, name, flags, seed):
        trained[name] = flags
        return tmp_path / name / f"seed-{seed}"

    monkeypatch.setattr(pseudo_labels, "label", label)
    monkeypatch.setattr(pseudo_labels.recipe_levers, "run_one", run_one)
    stages = [s["stage"] for s in pseudo_labels.run_all(args)]
    assert stages == ["teacher", "labels_1_ema", "labels_1_training", "round_1", "student_warm",
                      "full"]
    run = tmp_path / "teacher" / "seed-1234" / "run"
    assert labelled_by == {"labels_1_ema": run / "latest.pt",
                           "labels_1_training": run / "latest_training_weights.pt",
                           "labels_1": run / "latest.pt"}
    assert trained["student_warm"][-4:] == ["--init_from", str(run / "latest.pt"),
                                            "--max_steps", "9"]
    assert trained["student_warm"][:4] == trained["round_1"][:4]  # the same labels


def test_a_teacher_given_is_not_trained_and_labels_round_1(tmp_path, monkeypatch):
    tuned = tmp_path / "pretrain" / "tuned" / "seed-1234"
    args = pseudo_labels.parse_args([
        "--out", str(tmp_path), "--rounds", "1", "--full", str(tmp_path / "full"),
        "--teacher", str(tuned)])
    monkeypatch.setattr(pseudo_labels, "split_corpus", lambda *a: (tmp_path / "l.jsonl", None))
    labelled_by, trained = {}, []

    def label(args, teacher, audio, out, flags=None):
        labelled_by[out.name] = teacher
        return {}

    monkeypatch.setattr(pseudo_labels, "label", label)
    monkeypatch.setattr(pseudo_labels.recipe_levers, "run_one", lambda la, name, flags, seed: (
        trained.append(name) or tmp_path / name / f"seed-{seed}"))
    stages = {s["stage"]: s for s in pseudo_labels.run_all(args)}
    assert trained == ["round_1"]
    assert stages["teacher"]["dir"] == tuned
    assert labelled_by == {"labels_1": tuned / "run" / "latest.pt"}


def test_weights_and_student_variants_are_refused_where_they_name_nothing(tmp_path, capsys):
    for argv, message in (
            (["--variant_weights", "x=latest_training_weights.pt"],
             "--variant_weights x: no such --label_variant"),
            (["--rounds", "0", "--student_variant", "w=--lr 1e-3"],
             "--student_variant: a student of round 1's labels needs --rounds 1 or more")):
        with pytest.raises(SystemExit) as exit_info:
            pseudo_labels.parse_args(["--out", str(tmp_path), *argv])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_the_adaptation_labels_with_an_lm_of_the_full_models_tokenizer_and_its_variants_train(
        tmp_path, monkeypatch):
    full = tmp_path / "full"
    args = pseudo_labels.parse_args([
        "--out", str(tmp_path), "--rounds", "0", "--full", str(full), "--lm", "--adapt", "3",
        "--label_flags", "--jobs 2 --lm {lm}", "--adapt_variant", "w4=--pseudo_weight 4"])
    monkeypatch.setattr(pseudo_labels, "split_corpus", lambda *a: (tmp_path / "l.jsonl", None))
    monkeypatch.setattr(pseudo_labels, "synthesize_adapt", lambda *a: tmp_path / "adapt.jsonl")
    lms, labelled_with = [], {}
    monkeypatch.setattr(pseudo_labels, "train_lm", lambda args, model, labelled, name="lm": (
        lms.append((model, name)) or tmp_path / name / "best.pt"))

    def label(args, model, audio, out, flags=None):
        labelled_with[out.name] = (model, (args.label_flags if flags is None else flags)
                                   .format(lm=args.lm_path))
        return {}

    monkeypatch.setattr(pseudo_labels, "label", label)
    trained = {}
    monkeypatch.setattr(pseudo_labels.recipe_levers, "run_one", lambda la, name, flags, seed: (
        trained.update({name: flags}) or tmp_path / name))
    stages = pseudo_labels.run_all(args)
    assert [s["stage"] for s in stages][-3:] == ["adapt_control", "adapt", "adapt_w4"]
    assert trained["adapt_w4"] == [*trained["adapt"], "--pseudo_weight", "4"]
    assert "--pseudo_manifest" not in trained["adapt_control"]
    teacher = tmp_path / "teacher" / "run" / "latest.pt"
    assert lms == [(teacher, "lm"), (full / "run" / "latest.pt", "lm_full")]
    assert labelled_with["labels_adapt"] == (full / "run" / "latest.pt",
                                             f"--jobs 2 --lm {tmp_path / 'lm_full' / 'best.pt'}")


def test_each_adaptation_gets_its_held_out_line(tmp_path):
    corpus = tmp_path / "corpus"
    _write(corpus / "train.jsonl", [{"audio_filepath": "a.wav", "duration": 1.0, "text": "a"}])
    args = pseudo_labels.parse_args(["--out", str(tmp_path / "out"), "--corpus", str(corpus)])
    stages = [{"stage": name, "dir": _stage(tmp_path / name, cer)} for name, cer in (
        ("teacher", 30.0), ("full", 10.0), ("adapt_control", 20.0), ("adapt", 16.0),
        ("adapt_w4", 12.0))]
    text = pseudo_labels.table(args, stages)
    assert ("20.00% fine-tuned on the training set alone, 16.00% with its own audio "
            "pseudo-labelled: 20.0% relative.") in text
    assert "12.00% with its own audio pseudo-labelled (w4): 40.0% relative." in text
