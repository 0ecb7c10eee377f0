"""konkanivani-prepare on tiny sources the tests write: a Common Voice release (mp3 clips), Kaldi
data directories, a folder of audio with .txt transcripts and a saved Hugging Face dataset, each
with bad
rows that must be skipped, counted and named while the good ones make valid manifests."""
import io
import json
import sys

import numpy as np
import pytest
import soundfile as sf

from konkanivani.cli import prepare as prepare_cli
from konkanivani.cli import validate
from konkanivani.data.manifest import read_manifest, resolve_audio_path

TEXTS = ["हांव घरा वता", "तूं कितें करता", "आमी पणजेक गेलें", "ताणें जेवण केलें", "तो शाळेंत वता"]


def _tone(seconds, sr=16000, channels=1):
    t = np.arange(int(round(seconds * sr))) / sr
    x = 0.3 * np.sin(2 * np.pi * 220 * t).astype(np.float32)
    return np.stack([x] * channels, axis=1) if channels > 1 else x


def _audio(path, seconds, sr=16000, channels=1, **kwargs):
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(path), _tone(seconds, sr, channels), sr, **kwargs)
    return path


def _output_dir_flag(argv):
    """SOURCE SOURCE_DIR OUT_DIR ... as the tool spells it: SOURCE SOURCE_DIR --output_dir OUT_DIR
    ..."""
    return (
        [*argv[:2], "--output_dir", *argv[2:]]
        if len(argv) > 2 and not argv[2].startswith("-")
        else argv
    )


def _run(capsys, *argv):
    status = prepare_cli.main(_output_dir_flag([*map(str, argv), "--no_progress"]))
    return status, capsys.readouterr().out


def _rows(manifest):
    return [row for _, row in read_manifest(manifest)]


def _durations(manifest):
    """Each row's audio duration as soundfile reads the file its path names."""
    return [
        sf.info(str(resolve_audio_path(r["audio_filepath"], manifest.parent))).duration
        for r in _rows(manifest)
    ]


def _validates(manifest, capsys):
    status = validate.main([str(manifest), "--quiet"])
    out = capsys.readouterr().out
    assert status == 0, out
    return out


# --- Common Voice -------------------------------------------------------------------------------

CV_HEADER = [
    "client_id",
    "path",
    "sentence_id",
    "sentence",
    "up_votes",
    "down_votes",
    "age",
    "gender",
    "locale",
]


def _tsv(path, rows):
    lines = ["\t".join(CV_HEADER)] + [
        "\t".join([f"spk{i % 2}", clip, f"s{i}", text, "2", "0", "", "", "kok"])
        for i, (clip, text) in enumerate(rows)
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


@pytest.fixture
def cv_dir(tmp_path):
    if "MP3" not in sf.available_formats():
        pytest.skip(f"libsndfile {sf.__libsndfile_version__} cannot write MP3 (1.1 and later can)")
    cv = tmp_path / "cv"
    for i, seconds in enumerate([1.5, 2.0, 1.8, 1.6, 1.7]):  # 48 kHz mp3, as Common Voice ships
        _audio(cv / "clips" / f"common_voice_kok_{i}.mp3", seconds, sr=48000, format="MP3")
    (cv / "clips" / "broken.mp3").write_bytes(b"ID3 this is not an mp3 stream")
    _tsv(cv / "train.tsv", [("common_voice_kok_0.mp3", TEXTS[0]),
                            ("missing.mp3", TEXTS[1]),  # line 3
                            ("common_voice_kok_1.mp3", "  "),  # line 4
                            ("broken.mp3", TEXTS[2]),  # line 5
                            # a quote opens it
                            ("common_voice_kok_2.mp3", f'"{TEXTS[3]}" तो म्हणालो ')])
    _tsv(cv / "dev.tsv", [("common_voice_kok_3.mp3", TEXTS[4])])
    _tsv(cv / "test.tsv", [("common_voice_kok_4.mp3", TEXTS[1])])
    return cv


def test_commonvoice_release_becomes_three_valid_manifests_and_bad_rows_are_counted(
    cv_dir, tmp_path, capsys
):
    out = tmp_path / "manifests"
    status, printed = _run(capsys, "commonvoice", cv_dir, out)
    assert status == 0, printed
    train = _rows(out / "train.jsonl")
    # unquoted, stripped
    assert [r["text"] for r in train] == [TEXTS[0], f'"{TEXTS[3]}" तो म्हणालो']
    assert [r["speaker"] for r in train] == ["spk0", "spk0"]
    assert [r["duration"] for r in train] == pytest.approx([1.5, 1.8], abs=1e-3)
    # outside OUT_DIR: absolute
    assert train[0]["audio_filepath"] == str(cv_dir / "clips" / "common_voice_kok_0.mp3")
    assert [len(_rows(out / f"{s}.jsonl")) for s in ("valid", "test")] == [1, 1]
    assert "skipped 3 of 7 utterances" in printed
    for reason in ("audio file missing", "empty text", "audio unreadable"):
        assert f"     1 {reason}" in printed
    for line in (3, 4, 5):
        assert f"{cv_dir / 'train.tsv'}:{line}: " in printed
    assert "note: 4 rows not 16 kHz" in printed  # the good rows, all 48 kHz
    for split in ("train", "valid", "test"):
        _validates(out / f"{split}.jsonl", capsys)


def test_commonvoice_convert_writes_16khz_wavs_beside_the_manifest(cv_dir, tmp_path, capsys):
    out = tmp_path / "manifests"
    status, printed = _run(capsys, "commonvoice", cv_dir, out, "--convert", "wav")
    assert status == 0, printed
    train = _rows(out / "train.jsonl")
    assert [r["audio_filepath"] for r in train] == [
        "clips/common_voice_kok_0.wav",
        "clips/common_voice_kok_2.wav",
    ]
    info = sf.info(str(out / "clips" / "common_voice_kok_0.wav"))
    assert (info.samplerate, info.channels, info.subtype) == (16000, 1, "PCM_16")
    assert _durations(out / "train.jsonl") == pytest.approx([1.5, 1.8], abs=1e-3)
    assert "not 16 kHz" not in printed and "skipped 3 of 7" in printed
    assert "not 16 kHz" not in _validates(out / "train.jsonl", capsys)


def test_commonvoice_folder_without_tsv_is_one_clear_error(tmp_path, capsys):
    (tmp_path / "cv").mkdir()
    assert (
        prepare_cli.main(
            ["commonvoice", str(tmp_path / "cv"), "--output_dir", str(tmp_path / "out")]
        )
        == 2
    )
    assert "no train.tsv, dev.tsv or test.tsv" in capsys.readouterr().err


# --- Kaldi --------------------------------------------------------------------------------------

def _kaldi_dir(path, files):
    path.mkdir(parents=True)
    for name, lines in files.items():
        (path / name).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_kaldi_segments_are_cut_to_their_times_and_commands_are_skipped(tmp_path, capsys):
    rec1 = _audio(tmp_path / "audio" / "rec1.wav", 4.0, sr=8000, channels=2)
    _audio(tmp_path / "audio" / "rec2.flac", 3.0)
    data = _kaldi_dir(
        tmp_path / "data" / "train",
        {
            "wav.scp": [
                f"rec1 {rec1}",
                "rec2 audio/rec2.flac",
                "rec3 sox audio/rec3.wav -t wav - |",
                "rec4 audio/gone.wav",
            ],
            "segments": [
                "u1 rec1 0.00 1.20",
                "u2 rec1 1.20 2.70",
                "u3 rec2 1.25 -1",
                "u4 rec3 0 1.5",
                "u5 rec1 2.0 1.0",
                "u6 rec4 0 1.5",
                "u7 rec1 9.0 10.0",
                "u9 rec1 0 1.5",
            ],
            "text": [
                f"u1 {TEXTS[0]}",
                f"u2 {TEXTS[1]}",
                f"u3 {TEXTS[2]}",
                f"u4 {TEXTS[3]}",
                f"u5 {TEXTS[4]}",
                f"u6 {TEXTS[0]}",
                f"u7 {TEXTS[1]}",
                f"u8 {TEXTS[2]}",
                "u9",
            ],
            "utt2spk": ["u1 alice", "u2 bob", "u3 alice"],
        },
    )
    out = tmp_path / "out"
    status, printed = _run(capsys, "kaldi", data, out, "--audio_root", tmp_path)
    assert status == 0, printed
    rows = _rows(out / "train.jsonl")
    assert [r["audio_filepath"] for r in rows] == ["wavs/u1.wav", "wavs/u2.wav", "wavs/u3.wav"]
    assert [r["speaker"] for r in rows] == ["alice", "bob", "alice"]
    assert [r["duration"] for r in rows] == pytest.approx([1.2, 1.5, 1.75], abs=1e-3)
    assert _durations(out / "train.jsonl") == pytest.approx([1.2, 1.5, 1.75], abs=1e-3)
    cut, _ = sf.read(str(out / "wavs" / "u2.wav"))
    # the right span (its edges hold the resampler's ramp)
    expected = _tone(4.0)[int(1.2 * 16000):int(2.7 * 16000)]
    np.testing.assert_allclose(cut[200:-200], expected[200:-200], atol=0.02)
    assert "skipped 6 of 9 utterances" in printed
    for reason in ("wav.scp entry is a command", "bad segments line", "audio file missing",
                   "segment outside its recording", "not in segments", "empty text"):
        assert reason in printed
    assert (
        f"{data / 'text'}:4: wav.scp entry is a command" in printed
        and f"{data / 'wav.scp'}:3" in printed
    )
    _validates(out / "train.jsonl", capsys)


def test_kaldi_without_segments_names_the_recordings_and_carves_a_valid_split(
    tmp_path, capsys, monkeypatch
):
    wavs = [_audio(tmp_path / "wav" / f"r{i}.wav", 1.5 + 0.1 * i) for i in range(5)]
    data = _kaldi_dir(tmp_path / "data", {"wav.scp": [f"r{i} wav/r{i}.wav" for i in range(5)],
                                          # tabs separate too
                                          "text": [f"r{i}\t{TEXTS[i]}" for i in range(5)]})
    monkeypatch.chdir(tmp_path)  # relative wav.scp paths start from the current folder, as in Kaldi
    status, printed = _run(
        capsys, "kaldi", data, tmp_path / "out", "--valid_fraction", "0.4", "--seed", "1"
    )
    assert status == 0, printed
    train, valid = _rows(tmp_path / "out" / "train.jsonl"), _rows(tmp_path / "out" / "valid.jsonl")
    assert (len(train), len(valid)) == (3, 2)
    assert sorted(r["audio_filepath"] for r in train + valid) == [str(w) for w in wavs]
    assert "skipped" not in printed


# --- a folder of audio and .txt ---------------------------------------------------------------

def test_folder_of_audio_with_txt_transcripts(tmp_path, capsys):
    clips = tmp_path / "clips"
    _audio(clips / "a.wav", 1.5)
    _audio(clips / "deep" / "er" / "b.flac", 2.0)
    _audio(clips / "c.wav", 1.5)  # no transcript
    (clips / "d.wav").write_bytes(b"RIFF\x00\x00not really a wav file")
    _audio(clips / "e.wav", 1.5)
    for name, text in [
        ("a", f"  {TEXTS[0]}\n"),
        ("deep/er/b", TEXTS[1]),
        ("d", TEXTS[2]),
        ("e", "\n"),
    ]:
        (clips / f"{name}.txt").write_text(text, encoding="utf-8")
    (clips / "notes.txt").write_text("not a transcript", encoding="utf-8")
    out = tmp_path / "out"
    status, printed = _run(capsys, "folder", clips, out)
    assert status == 0, printed
    rows = _rows(out / "train.jsonl")
    assert rows == [
        {"audio_filepath": str(clips / "a.wav"), "duration": 1.5, "text": TEXTS[0]},
        {"audio_filepath": str(clips / "deep/er/b.flac"), "duration": 2.0, "text": TEXTS[1]},
    ]
    assert "skipped 3 of 5 utterances" in printed
    assert f"{clips / 'c.wav'}: no transcript (.txt) beside it" in printed
    assert (
        f"{clips / 'd.txt'}: audio unreadable" in printed
        and f"{clips / 'e.txt'}: empty text" in printed
    )
    _validates(out / "train.jsonl", capsys)


def test_folder_convert_into_a_folder_inside_the_source_does_not_read_its_own_output_again(
    tmp_path, capsys
):
    _audio(tmp_path / "c" / "a.wav", 1.5, sr=44100, channels=2)
    (tmp_path / "c" / "a.txt").write_text(TEXTS[0], encoding="utf-8")
    out = tmp_path / "c" / "prepared"
    for _ in range(2):
        status, printed = _run(capsys, "folder", tmp_path / "c", out, "--convert", "flac")
        assert status == 0 and "skipped" not in printed, printed
        assert _rows(out / "train.jsonl") == [
            {"audio_filepath": "wavs/a.flac", "duration": 1.5, "text": TEXTS[0]}
        ]
    info = sf.info(str(out / "wavs" / "a.flac"))
    assert (info.format, info.samplerate, info.channels) == ("FLAC", 16000, 1)


def test_nothing_usable_writes_no_manifest_and_exits_1(tmp_path, capsys):
    (tmp_path / "clips").mkdir()
    (tmp_path / "clips" / "x.wav").write_bytes(b"junk")
    (tmp_path / "clips" / "x.txt").write_text(TEXTS[0], encoding="utf-8")
    status, printed = _run(
        capsys, "folder", tmp_path / "clips", tmp_path / "out", "--split_name", "mine"
    )
    assert status == 1 and "no usable utterance" in printed
    assert not (tmp_path / "out" / "mine.jsonl").exists()


def test_bad_flags_are_one_line_exit_2(tmp_path, capsys):
    out = str(tmp_path / "out")
    for argv in (["folder", str(tmp_path / "nope"), "--output_dir", out],
                 ["folder", str(tmp_path), "--output_dir", out, "--valid_fraction", "1.5"],
                 ["kaldi", str(tmp_path), "--output_dir", out, "--max_duration", "0"],
                 ["kaldi", str(tmp_path)]):  # no output folder
        with pytest.raises(SystemExit) as e:
            prepare_cli.main(argv)
        assert e.value.code == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1


# --- Hugging Face datasets ----------------------------------------------------------------------

def _encoded(seconds, sr=16000, fmt="WAV"):
    buf = io.BytesIO()
    sf.write(buf, _tone(seconds, sr), sr, format=fmt)
    return buf.getvalue()


def test_hf_dataset_saved_to_disk_is_decoded_to_wavs(tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    # Stored as {"bytes", "path"} and cast to Audio: building it from arrays would need an audio
    # encoder.
    train = datasets.Dataset.from_dict(
        {
            "audio": [
                {"bytes": _encoded(1.5), "path": "a.wav"},
                {"bytes": _encoded(2.0, 22050, "FLAC"), "path": "b.flac"},
                {"bytes": b"not audio at all", "path": "c.wav"},
                {"bytes": _encoded(1.5), "path": "d.wav"},
            ],
            "transcription": [TEXTS[0], f" {TEXTS[1]} ", TEXTS[2], None],
            "speaker": ["x", "y", "z", "w"],
        }
    ).cast_column("audio", datasets.Audio())
    validation = datasets.Dataset.from_dict(
        {
            "audio": [{"bytes": _encoded(1.8, 8000), "path": "e.wav"}],
            "transcription": [TEXTS[3]],
            "speaker": ["v"],
        }
    ).cast_column("audio", datasets.Audio())
    datasets.DatasetDict({"train": train, "validation": validation}).save_to_disk(
        str(tmp_path / "hf")
    )
    out = tmp_path / "out"
    status, printed = _run(capsys, "hf", tmp_path / "hf", out)
    assert status == 0, printed
    rows = _rows(out / "train.jsonl")
    assert [(r["audio_filepath"], r["text"]) for r in rows] == [("wavs/train_000000.wav", TEXTS[0]),
                                                               ("wavs/train_000001.wav", TEXTS[1])]
    assert _durations(out / "train.jsonl") == pytest.approx([1.5, 2.0], abs=1e-3)
    assert sf.info(str(out / "wavs" / "train_000001.wav")).samplerate == 16000
    assert [r["audio_filepath"] for r in _rows(out / "valid.jsonl")] == ["wavs/valid_000000.wav"]
    assert "skipped 2 of 5 utterances" in printed
    assert f"{tmp_path / 'hf'} train row 2: audio unreadable" in printed
    assert f"{tmp_path / 'hf'} train row 3: empty text" in printed
    for split in ("train", "valid"):
        _validates(out / f"{split}.jsonl", capsys)


def test_hf_single_dataset_with_a_chosen_text_column(tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict(
        {
            "clip": [{"bytes": _encoded(1.5 + 0.1 * i), "path": f"{i}.wav"} for i in range(4)],
            "words": TEXTS[:4],
        }
    ).cast_column("clip", datasets.Audio())
    ds.save_to_disk(str(tmp_path / "hf"))
    assert (
        prepare_cli.main(["hf", str(tmp_path / "hf"), "--output_dir", str(tmp_path / "out")]) == 2
    )
    assert (
        "no text column found; its columns: clip, words (--text_column chooses)"
        in capsys.readouterr().err
    )
    status, printed = _run(
        capsys,
        "hf",
        tmp_path / "hf",
        tmp_path / "out",
        "--text_column",
        "words",
        "--split_name",
        "all",
        "--valid_fraction",
        "0.25",
    )
    assert status == 0, printed
    assert [len(_rows(tmp_path / "out" / f"{s}.jsonl")) for s in ("all", "valid")] == [3, 1]


def test_hf_without_datasets_says_how_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets raises ImportError
    assert prepare_cli.main(["hf", str(tmp_path), "--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'konkanivani[hf]'" in err


def test_written_rows_are_json_lines_with_the_three_keys_first(tmp_path, capsys):
    _audio(tmp_path / "c" / "a.wav", 1.5)
    (tmp_path / "c" / "a.txt").write_text(TEXTS[0], encoding="utf-8")
    _run(capsys, "folder", tmp_path / "c", tmp_path / "out")
    line = (tmp_path / "out" / "train.jsonl").read_text(encoding="utf-8")
    # not \u-escaped
    assert list(json.loads(line)) == ["audio_filepath", "duration", "text"] and TEXTS[0] in line
