"""Faults around the data tools, in the style of the trainer's: every importer of
``konkanivani-prepare`` fed inputs whose names collide, names that are ``.``, ``..``, absolute or
climb out with ``../``, an output folder that is (or contains) its input, and a run killed in the
middle and run again; the demo corpus killed while it regenerates.

Whatever happens, every manifest row's audio must be the audio of its own source row: the tests
compare samples, never names.
"""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from konkanivani.cli import prepare as prepare_cli
from konkanivani.data.manifest import read_manifest, resolve_audio_path
from konkanivani.datatools import importers as prepare_module
from konkanivani.datatools.outputs import child, safe_name

SR = 16000
TEXTS = [
    "हांव घरा वता",
    "तूं कितें करता",
    "आमी पणजेक गेलें",
    "ताणें जेवण केलें",
    "तो शाळेंत वता",
    "ती गावांत रावता",
]


def _noise(seed, seconds=1.0):
    """Audio that no other test file shares: seeded noise, exact in 16-bit PCM."""
    return np.random.default_rng(seed).integers(-8000, 8000, int(seconds * SR)).astype(np.int16)


def _write(path, samples):
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(path), samples, SR, subtype="PCM_16")
    return path


def _read(path):
    return sf.read(str(path), dtype="int16")[0]


def _rows(manifest):
    return [row for _, row in read_manifest(manifest)]


def _audio_by_text(manifest):
    """text -> the samples of the file that the row names."""
    return {
        r["text"]: _read(resolve_audio_path(r["audio_filepath"], manifest.parent))
        for r in _rows(manifest)
    }


def _output_dir_flag(argv):
    """SOURCE SOURCE_DIR OUT_DIR ... as the tool spells it: SOURCE SOURCE_DIR --output_dir OUT_DIR
    ..."""
    return (
        [*argv[:2], "--output_dir", *argv[2:]]
        if len(argv) > 2 and not argv[2].startswith("-")
        else argv
    )


def _run(capsys, *argv):
    try:
        status = prepare_cli.main(_output_dir_flag([*map(str, argv), "--no_progress"]))
    except SystemExit as e:  # a flag refused by the parser: one line, exit 2
        status = e.code
    captured = capsys.readouterr()
    return status, captured.out + captured.err


def _files(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


# --- names ------------------------------------------------------------------------------------

def test_safe_names_are_plain_and_never_shared():
    keys = [
        "a_b",
        "a/b",
        "a\\b",
        ".",
        "..",
        "../x",
        "/abs/x",
        ".hidden",
        "a b",
        "क/ख",
        "x" * 300,
        "",
        "-",
        "ok.1",
    ]
    names = [safe_name(k) for k in keys]
    assert len(set(names)) == len(keys)
    for name in names:
        assert (
            name
            and "/" not in name
            and "\\" not in name
            and not name.startswith(".")
            and len(name) <= 120
        )
    assert safe_name("a_b") == "a_b" and safe_name("common_voice_kok_0") == "common_voice_kok_0"


@pytest.mark.parametrize("name", ["", ".", "..", "../x", "a/b", "/abs", ".x"])
def test_a_chosen_name_that_would_leave_its_folder_is_refused(tmp_path, name):
    with pytest.raises(ValueError, match="not a plain name"):
        child(tmp_path, name, "--split_name")


# --- Kaldi --------------------------------------------------------------------------------------

def _kaldi(folder, recordings, segments, texts):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "wav.scp").write_text(
        "".join(f"{r} {p}\n" for r, p in recordings.items()), encoding="utf-8"
    )
    if segments is not None:
        (folder / "segments").write_text(
            "".join(f"{u} {r} {s} {e}\n" for u, (r, s, e) in segments.items()), encoding="utf-8"
        )
    (folder / "text").write_text("".join(f"{u} {t}\n" for u, t in texts.items()), encoding="utf-8")
    return folder


def test_kaldi_ids_that_collide_or_climb_out_each_get_their_own_segment(tmp_path, capsys):
    """Ids a/b and a_b used to share wavs/a_b.wav (the second clip, both rows); '.' and '..' stopped
    every row; '../x' became a hidden file. Now each row's file holds its own segment, inside wavs/.
    """
    rec = _noise(1, seconds=6.0)
    source = _write(tmp_path / "rec.wav", rec)
    ids = ["a/b", "a_b", ".", "..", "../up", "/abs"]
    segments = {u: ("rec", f"{i:.1f}", f"{i + 0.9:.1f}") for i, u in enumerate(ids)}
    data = _kaldi(tmp_path / "data", {"rec": source}, segments, dict(zip(ids, TEXTS)))
    out = tmp_path / "out"
    status, printed = _run(capsys, "kaldi", data, out)
    assert status == 0 and "skipped" not in printed, printed
    got = _audio_by_text(out / "train.jsonl")
    assert sorted(got) == sorted(TEXTS)
    for i, text in enumerate(TEXTS):  # compare samples: the segment of this row's own id
        assert np.array_equal(got[text], rec[i * SR: i * SR + int(0.9 * SR)]), text
    written = _files(out / "wavs")
    assert len(written) == len(ids) and not any(Path(w).name.startswith(".") for w in written)
    # nothing outside out/
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "out", "rec.wav"]


def test_kaldi_into_its_own_data_directory_is_refused(tmp_path, capsys):
    source = _write(tmp_path / "data" / "rec.wav", _noise(2))
    data = _kaldi(tmp_path / "data", {"u1": source}, None, {"u1": TEXTS[0]})
    before = _files(data)
    for out in (data, tmp_path):  # the folder itself, and one that contains it
        status, printed = _run(capsys, "kaldi", data, out, "--convert", "wav")
        assert (
            status == 2
            and "never writes into its own input" in printed
            and "Traceback" not in printed
        )
        assert len(printed.strip().splitlines()) == 1, printed
    assert _files(data) == before


# --- a folder of audio ----------------------------------------------------------------------------

def test_folder_files_whose_flattened_names_collide_stay_apart(tmp_path, capsys):
    """a/b.wav and a_b.wav were both converted to wavs/a_b.wav."""
    clips = tmp_path / "clips"
    for i, name in enumerate(["a/b", "a_b", "a b", "x/.y"]):
        _write(clips / f"{name}.wav", _noise(10 + i))
        (clips / f"{name}.txt").write_text(TEXTS[i], encoding="utf-8")
    out = tmp_path / "out"
    status, printed = _run(capsys, "folder", clips, out, "--convert", "wav")
    assert status == 0 and "skipped" not in printed, printed
    got = _audio_by_text(out / "train.jsonl")
    for i, name in enumerate(["a/b", "a_b", "a b", "x/.y"]):
        assert np.array_equal(got[TEXTS[i]], _read(clips / f"{name}.wav")), name
    assert all(
        resolve_audio_path(r["audio_filepath"], out)
        .resolve()
        .is_relative_to(out.resolve() / "wavs")
        for r in _rows(out / "train.jsonl")
    )


def test_folder_two_sources_that_would_still_share_a_file_are_both_refused_by_name(
    tmp_path, capsys
):
    clips = tmp_path / "clips"
    _write(clips / "x.wav", _noise(20))
    sf.write(str(clips / "x.flac"), _noise(21), SR)
    (clips / "x.txt").write_text(TEXTS[0], encoding="utf-8")
    _write(clips / "y.wav", _noise(22))
    (clips / "y.txt").write_text(TEXTS[1], encoding="utf-8")
    status, printed = _run(capsys, "folder", clips, tmp_path / "out", "--convert", "wav")
    assert status == 0
    assert "2 two sources, one output file" in " ".join(printed.split())
    assert str(clips / "x.flac") in printed and str(clips / "x.wav") in printed
    got = _audio_by_text(tmp_path / "out" / "train.jsonl")
    assert list(got) == [TEXTS[1]] and np.array_equal(got[TEXTS[1]], _read(clips / "y.wav"))


@pytest.mark.parametrize("split_name", ["../escaped", "/tmp/abs", "..", "a/b", ".hidden"])
def test_a_split_name_cannot_place_the_manifest_outside_the_output_folder(
    tmp_path, capsys, split_name
):
    clips = tmp_path / "clips"
    _write(clips / "a.wav", _noise(30))
    (clips / "a.txt").write_text(TEXTS[0], encoding="utf-8")
    status, printed = _run(capsys, "folder", clips, tmp_path / "out", "--split_name", split_name)
    assert status == 2 and "--split_name" in printed and "not a plain name" in printed
    assert not (tmp_path / "out").exists() and not (tmp_path / "escaped.jsonl").exists()


def test_folder_into_itself_is_refused(tmp_path, capsys):
    clips = tmp_path / "clips"
    _write(clips / "a.wav", _noise(31))
    (clips / "a.txt").write_text(TEXTS[0], encoding="utf-8")
    status, printed = _run(capsys, "folder", clips, clips, "--convert", "wav")
    assert status == 2 and "is the source AUDIO_DIR" in printed
    assert _files(clips) == ["a.txt", "a.wav"]


# --- Common Voice -------------------------------------------------------------------------------

CV_HEADER = "client_id\tpath\tsentence\n"


def _cv(folder, rows):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.tsv").write_text(
        CV_HEADER + "".join(f"spk\t{p}\t{t}\n" for p, t in rows), encoding="utf-8"
    )
    return folder


def test_commonvoice_convert_into_the_release_itself_is_refused_and_the_clips_stay(
    tmp_path, capsys
):
    """`prepare commonvoice X X --convert wav` with .wav clips resampled X/clips/*.wav over the
    originals."""
    if "MP3" not in sf.available_formats():
        pytest.skip(
            "this libsndfile cannot read MP3, so the Common Voice importer refuses to start"
        )
    cv = _cv(tmp_path / "cv", [("a.wav", TEXTS[0])])
    clip = cv / "clips" / "a.wav"
    clip.parent.mkdir()
    sf.write(str(clip), _noise(40).astype(np.float32) / 32768, 48000, subtype="PCM_16")
    original = clip.read_bytes()
    status, printed = _run(capsys, "commonvoice", cv, cv, "--convert", "wav")
    assert status == 2 and "never writes into its own input" in printed
    assert clip.read_bytes() == original and not (cv / "train.jsonl").exists()


def test_commonvoice_clip_paths_that_collide_or_leave_clips_are_kept_apart_or_skipped(
    tmp_path, capsys
):
    if "MP3" not in sf.available_formats():
        pytest.skip(
            "this libsndfile cannot read MP3, so the Common Voice importer refuses to start"
        )
    cv = tmp_path / "cv"
    for i, name in enumerate(["a/c.wav", "a_c.wav", "a_c.flac"]):
        (cv / "clips" / name).parent.mkdir(parents=True, exist_ok=True)
        sf.write(str(cv / "clips" / name), _noise(50 + i), SR, subtype="PCM_16")
    _write(tmp_path / "outside.wav", _noise(59))
    # the same clip twice: one file
    _cv(cv, [("a/c.wav", TEXTS[0]), ("a_c.wav", TEXTS[1]), ("a_c.wav", TEXTS[2]),
             ("../../outside.wav", TEXTS[3]), (str(tmp_path / "outside.wav"), TEXTS[4])])
    out = tmp_path / "out"
    status, printed = _run(capsys, "commonvoice", cv, out, "--convert", "wav")
    assert status == 0, printed
    assert "2 clip path leaves clips/" in " ".join(printed.split())
    got = _audio_by_text(out / "train.jsonl")
    assert sorted(got) == sorted(TEXTS[:3])
    assert np.array_equal(got[TEXTS[0]], _read(cv / "clips" / "a/c.wav"))
    assert np.array_equal(got[TEXTS[1]], _read(cv / "clips" / "a_c.wav"))
    assert np.array_equal(got[TEXTS[2]], _read(cv / "clips" / "a_c.wav"))
    assert len(_files(out / "clips")) == 2


# --- Hugging Face ---------------------------------------------------------------------------------

def test_hf_into_the_dataset_folder_is_refused(tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict(
        {"audio": [{"bytes": _encoded(_noise(60)), "path": None}], "sentence": [TEXTS[0]]}
    )
    ds.cast_column("audio", datasets.Audio(decode=False)).save_to_disk(str(tmp_path / "hf"))
    before = _files(tmp_path / "hf")
    status, printed = _run(capsys, "hf", tmp_path / "hf", tmp_path / "hf")
    assert status == 2 and "never writes into its own input" in printed
    assert _files(tmp_path / "hf") == before
    status, printed = _run(capsys, "hf", tmp_path / "hf", tmp_path / "out", "--split_name", "../x")
    assert status == 2 and "not a plain name" in printed


def _encoded(samples):
    import io
    buffer = io.BytesIO()
    sf.write(buffer, samples, SR, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def test_hf_rows_each_keep_their_own_audio(tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    clips = [_noise(70 + i) for i in range(4)]
    ds = datasets.Dataset.from_dict({"audio": [{"bytes": _encoded(c), "path": None} for c in clips],
                                     "sentence": TEXTS[:4]})
    ds.cast_column("audio", datasets.Audio(decode=False)).save_to_disk(str(tmp_path / "hf"))
    status, printed = _run(capsys, "hf", tmp_path / "hf", tmp_path / "out")
    assert status == 0, printed
    got = _audio_by_text(tmp_path / "out" / "train.jsonl")
    for clip, text in zip(clips, TEXTS):
        assert np.array_equal(got[text], clip)


# --- interrupted and re-run -----------------------------------------------------------------------

def _two_generations(tmp_path, n=6):
    """A Kaldi data dir whose recordings are replaced between two prepare runs: run 1's audio and
    run 2's are different samples under the same ids and texts."""
    old = {f"u{i}": _noise(100 + i) for i in range(n)}
    new = {f"u{i}": _noise(200 + i) for i in range(n)}
    for u, samples in old.items():
        _write(tmp_path / "v1" / f"{u}.wav", samples)
        _write(tmp_path / "v2" / f"{u}.wav", new[u])
    texts = {f"u{i}": TEXTS[i % len(TEXTS)] + f" {i}" for i in range(n)}
    data1 = _kaldi(tmp_path / "d1", {u: tmp_path / "v1" / f"{u}.wav" for u in old}, None, texts)
    data2 = _kaldi(tmp_path / "d2", {u: tmp_path / "v2" / f"{u}.wav" for u in new}, None, texts)
    return data1, data2, old, new, texts


def _assert_manifest_matches(out, audio, texts):
    got = _audio_by_text(out / "train.jsonl")
    assert sorted(got) == sorted(texts.values())
    for u, text in texts.items():
        assert np.array_equal(got[text], audio[u]), u


def test_prepare_interrupted_leaves_the_previous_result_whole_and_a_rerun_finishes(
    tmp_path, capsys, monkeypatch
):
    data1, data2, old, new, texts = _two_generations(tmp_path)
    out = tmp_path / "out"
    assert _run(capsys, "kaldi", data1, out, "--convert", "wav")[0] == 0
    _assert_manifest_matches(out, old, texts)

    real_write, calls = sf.write, []

    def write_then_interrupt(*args, **kwargs):  # Ctrl-C after the third converted file
        calls.append(args[0])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_write(*args, **kwargs)

    monkeypatch.setattr(prepare_module.sf, "write", write_then_interrupt)
    status, printed = _run(capsys, "kaldi", data2, out, "--convert", "wav")
    assert status == 130 and "interrupted" in printed and "Traceback" not in printed
    monkeypatch.setattr(prepare_module.sf, "write", real_write)
    _assert_manifest_matches(out, old, texts)  # the old result, whole: no new audio under old names
    assert not (out / ".prepare.partial").exists()

    assert _run(capsys, "kaldi", data2, out, "--convert", "wav")[0] == 0
    _assert_manifest_matches(out, new, texts)


def test_a_rerun_without_a_split_removes_the_old_manifest_of_that_split(tmp_path, capsys):
    """A valid.jsonl of the first run must not survive to name the second run's audio."""
    data1, data2, old, new, texts = _two_generations(tmp_path)
    out = tmp_path / "out"
    assert _run(capsys, "kaldi", data1, out, "--convert", "wav", "--valid_fraction", "0.4")[0] == 0
    assert (out / "valid.jsonl").is_file()
    assert _run(capsys, "kaldi", data2, out, "--convert", "wav")[0] == 0
    assert not (out / "valid.jsonl").exists()
    _assert_manifest_matches(out, new, texts)


def test_a_file_prepare_did_not_write_is_never_replaced(tmp_path, capsys):
    data1, _, old, _, texts = _two_generations(tmp_path)
    out = tmp_path / "out"
    mine = _write(out / "wavs" / "mine.wav", _noise(300)).read_bytes()
    assert _run(capsys, "kaldi", data1, out, "--convert", "wav")[0] == 0  # beside it: fine
    _assert_manifest_matches(out, old, texts)
    assert (out / "wavs" / "mine.wav").read_bytes() == mine
    # as if an older konkanivani had written wavs/u0.wav: not ours to replace
    (out / ".prepare.json").unlink()
    before = (out / "wavs" / "u0.wav").read_bytes()
    status, printed = _run(capsys, "kaldi", data1, out, "--convert", "wav")
    assert status == 2 and "was not written by konkanivani-prepare" in printed
    assert (out / "wavs" / "u0.wav").read_bytes() == before and (
        out / "wavs" / "mine.wav"
    ).read_bytes() == mine


def test_splits_prepared_one_at_a_time_into_one_folder_keep_each_other(tmp_path, capsys):
    """kaldi data/train then kaldi data/test into one OUT_DIR: the second run adds test.jsonl and
    its
    audio and leaves train's; running train again replaces train's alone."""
    train = {f"tr{i}": _noise(600 + i) for i in range(3)}
    test = {f"te{i}": _noise(700 + i) for i in range(2)}
    for u, samples in {**train, **test}.items():
        _write(tmp_path / "audio" / f"{u}.wav", samples)
    texts = {u: f"{TEXTS[i % len(TEXTS)]} {u}" for i, u in enumerate([*train, *test])}
    d_train = _kaldi(tmp_path / "train", {u: tmp_path / "audio" / f"{u}.wav" for u in train}, None,
                     {u: texts[u] for u in train})
    d_test = _kaldi(tmp_path / "test", {u: tmp_path / "audio" / f"{u}.wav" for u in test}, None,
                    {u: texts[u] for u in test})
    out = tmp_path / "out"
    assert _run(capsys, "kaldi", d_train, out, "--convert", "wav", "--split_name", "train")[0] == 0
    assert _run(capsys, "kaldi", d_test, out, "--convert", "wav", "--split_name", "test")[0] == 0
    for split, audio in (("train", train), ("test", test)):
        got = _audio_by_text(out / f"{split}.jsonl")
        assert sorted(got) == sorted(texts[u] for u in audio)
        assert all(np.array_equal(got[texts[u]], audio[u]) for u in audio)
    assert _run(capsys, "kaldi", d_train, out, "--convert", "wav", "--split_name", "train")[0] == 0
    assert sorted(_audio_by_text(out / "test.jsonl")) == sorted(texts[u] for u in test)
    assert len(_files(out / "wavs")) == 5


def test_a_kill_while_publishing_does_not_block_the_next_run(tmp_path, capsys, monkeypatch):
    """Ctrl-C between the renames of publishing: the next run starts clean and finishes."""
    from konkanivani.datatools import outputs
    data1, data2, old, new, texts = _two_generations(tmp_path)
    out = tmp_path / "out"
    assert _run(capsys, "kaldi", data1, out, "--convert", "wav")[0] == 0
    real, moved = outputs.Staging._move_in, []

    def move_then_interrupt(self, relative):
        moved.append(relative)
        if len(moved) == 3:
            raise KeyboardInterrupt
        return real(self, relative)

    monkeypatch.setattr(outputs.Staging, "_move_in", move_then_interrupt)
    assert _run(capsys, "kaldi", data2, out, "--convert", "wav")[0] == 130
    monkeypatch.setattr(outputs.Staging, "_move_in", real)
    assert not (out / "train.jsonl").exists()  # no manifest naming another build's audio
    assert _run(capsys, "kaldi", data2, out, "--convert", "wav")[0] == 0
    _assert_manifest_matches(out, new, texts)
    assert not (out / ".prepare.old").exists() and not (out / ".prepare.partial").exists()


@pytest.mark.slow
def test_prepare_killed_by_a_real_ctrl_c_exits_130_without_a_traceback(tmp_path):
    data1, data2, old, new, texts = _two_generations(tmp_path, n=6)
    out = tmp_path / "out"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "konkanivani.cli.prepare",
            "kaldi",
            str(data1),
            "--output_dir",
            str(out),
            "--convert",
            "wav",
            "--no_progress",
        ],
        check=True,
        capture_output=True,
    )
    # long enough to be caught in the middle
    many = {f"w{i}": _noise(400 + i, seconds=2.0) for i in range(400)}
    for u, samples in many.items():
        _write(tmp_path / "v3" / f"{u}.wav", samples)
    data3 = _kaldi(tmp_path / "d3", {u: tmp_path / "v3" / f"{u}.wav" for u in many}, None,
                   {u: f"{TEXTS[0]} {u}" for u in many})
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "konkanivani.cli.prepare",
            "kaldi",
            str(data3),
            "--output_dir",
            str(out),
            "--convert",
            "wav",
            "--no_progress",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    staged = out / ".prepare.partial" / "wavs"
    for _ in range(600):  # until it has written some files (bounded: 600 polls)
        if proc.poll() is not None or (staged.is_dir() and len(list(staged.iterdir())) >= 5):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted" in err
    _assert_manifest_matches(out, old, texts)
    assert not (out / ".prepare.partial").exists()


# --- the demo corpus ------------------------------------------------------------------------------

def _snapshot(corpus):
    """Every manifest's bytes and every row's audio bytes."""
    snap = {}
    for manifest in sorted(corpus.glob("*.jsonl")):
        snap[manifest.name] = manifest.read_bytes()
        for r in _rows(manifest):
            snap[r["audio_filepath"]] = (corpus / r["audio_filepath"]).read_bytes()
    return snap


@pytest.mark.slow
def test_demo_corpus_killed_while_regenerating_keeps_the_old_corpus(tiny_corpus, tmp_path):
    """Another --seed killed after a few files used to leave the old manifests over new audio."""
    import shutil

    corpus = tmp_path / "demo"
    shutil.copytree(tiny_corpus, corpus)
    before = _snapshot(corpus)
    info = json.loads((corpus / "corpus_info.json").read_text())
    command = [
        sys.executable,
        "-m",
        "konkanivani.cli.demo_corpus",
        "--output_dir",
        str(corpus),
        "--seed",
        "4",
        "--num_utterances",
        str(info["num_utterances"]),
        "--max_sentences",
        str(info["max_sentences"]),
        "--jobs",
        "2",
        "--festival_share",
        "0",
    ]
    for sig in (signal.SIGKILL, signal.SIGINT):
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=sig == signal.SIGKILL,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        staged = corpus / ".demo_corpus.partial" / "wavs"
        leftover = staged / "left-by-the-killed-run"  # gone once this run has started its own build
        if staged.is_dir():
            leftover.touch()
        for _ in range(1200):  # until this run has synthesized a few files (bounded: 1200 polls)
            with contextlib.suppress(FileNotFoundError):
                if proc.poll() is not None or (staged.is_dir() and not leftover.exists()
                                               and len(list(staged.glob("*.wav"))) >= 4):
                    break
            time.sleep(0.05)
        assert proc.poll() is None, "the corpus finished before it could be stopped"
        if sig == signal.SIGKILL:
            # the tool and its synthesis workers, as a kill -9 of the group
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        if sig == signal.SIGINT:
            assert proc.returncode == 130 and "Traceback" not in err and "interrupted" in err, err
            assert not (corpus / ".demo_corpus.partial").exists()
        assert _snapshot(corpus) == before  # the old corpus, byte for byte, audio included
    # A re-run after the kill starts clean: the corpus it leaves is the one a fresh run makes.
    assert subprocess.run(command, capture_output=True).returncode == 0
    assert not (corpus / ".demo_corpus.partial").exists()
    assert not [p for p in corpus.rglob(".*") if p.is_file() and p.name != "corpus_info.json"]
    fresh = tmp_path / "fresh"
    assert (
        subprocess.run([*command[:4], str(fresh), *command[5:]], capture_output=True).returncode
        == 0
    )
    assert _snapshot(corpus) == _snapshot(fresh) != before


# --- tools that write next to what they read ------------------------------------------------------

def test_average_never_writes_over_a_checkpoint_it_reads_or_a_runs_own_names(tmp_path, capsys):
    from konkanivani.checkpoint import save_checkpoint
    from konkanivani.cli import average

    # a run's folder
    inputs = [save_checkpoint({"model": {}}, tmp_path / f"step_000000{n}.pt") for n in (1, 2)]
    before = [p.read_bytes() for p in inputs]
    for output in (inputs[0], tmp_path / "latest.pt", tmp_path / "step_0000100.pt"):
        status = average.main(["--inputs", *map(str, inputs), "--output", str(output)])
        err = capsys.readouterr().err
        assert status == 2 and len(err.strip().splitlines()) == 1 and str(output) in err, err
    assert [p.read_bytes() for p in inputs] == before and not (tmp_path / "latest.pt").exists()


def test_validate_output_may_not_be_the_manifest_it_reads(tmp_path, capsys):
    from konkanivani.cli import validate

    _write(tmp_path / "a.wav", _noise(500))
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(
        json.dumps({"audio_filepath": "a.wav", "duration": 1.0, "text": TEXTS[0]})
        + "\n"
        + "not json\n",
        encoding="utf-8",
    )
    before = manifest.read_bytes()
    with pytest.raises(SystemExit) as exit_:
        validate.main([str(manifest), "--output", str(manifest)])
    assert exit_.value.code == 2 and "never rewrites its own input" in capsys.readouterr().err
    assert manifest.read_bytes() == before


@pytest.mark.parametrize("tool_name", ["transcribe", "evaluate"])
def test_decoding_tools_never_write_their_results_over_the_manifest_they_read(
    tmp_path, capsys, tool_name
):
    import importlib

    tool = importlib.import_module(f"konkanivani.cli.{tool_name}")
    (tmp_path / "model.pt").write_bytes(b"never loaded: the flags are refused first")
    manifest = tmp_path / "test.jsonl"
    manifest.write_text(
        json.dumps({"audio_filepath": "a.wav", "duration": 1.0, "text": TEXTS[0]}) + "\n",
        encoding="utf-8",
    )
    before = manifest.read_bytes()
    with pytest.raises(SystemExit) as exit_:
        tool.main([str(tmp_path / "model.pt"), str(manifest), "--output", str(manifest)])
    err = capsys.readouterr().err
    assert (
        exit_.value.code == 2
        and "never rewrites its own input" in err
        and len(err.strip().splitlines()) == 1
    )
    assert manifest.read_bytes() == before
