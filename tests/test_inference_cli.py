"""transcribe.py, evaluate.py and average_checkpoints.py on a tiny trained model and real audio."""
import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
import torchaudio
from scipy.signal import resample_poly

ROOT = Path(__file__).resolve().parents[1]
from konkanivani.checkpoint import CheckpointError, load_checkpoint, save_checkpoint  # noqa: E402
from konkanivani.cli import average as average_checkpoints  # noqa: E402
from konkanivani.cli import evaluate, transcribe  # noqa: E402
from konkanivani.config import TrainConfig, model_config_from_preset  # noqa: E402
from konkanivani.data.audio import load_audio  # noqa: E402
from konkanivani.data.manifest import read_manifest  # noqa: E402
from konkanivani.data.tokenizer import train_tokenizer  # noqa: E402
from konkanivani.decoding.evaluation import score  # noqa: E402
from konkanivani.model.asr import ASRModel  # noqa: E402
from konkanivani.training.loop import train  # noqa: E402


@pytest.fixture(scope="module")
def audio_dir(tiny_corpus, tmp_path_factory):
    """Three clips of the corpus: as they are (16 kHz mono), as 44.1 kHz stereo, and a broken
    file."""
    out = tmp_path_factory.mktemp("clips")
    rows = read_manifest(tiny_corpus / "test.jsonl")
    src = tiny_corpus / rows[0][1]["audio_filepath"]
    shutil.copy(src, out / "a_mono16k.wav")
    wav, sr = sf.read(src, dtype="float32")
    wav44 = resample_poly(wav, 441, 160).astype(np.float32)
    sf.write(out / "b_stereo44k.wav", np.stack([1.5 * wav44, 0.5 * wav44], axis=1), 44100,
             subtype="FLOAT")  # mean: wav44, unclipped
    (out / "c_broken.wav").write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunk" + bytes(100))
    return out


def test_transcribe_files_folder_and_manifest(tiny_run, tiny_corpus, audio_dir, tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    code = transcribe.main(
        [str(tiny_run / "latest.pt"), str(audio_dir), "--method", "greedy", "--output", str(out)]
    )
    assert code == 1  # one file could not be read
    err = capsys.readouterr().err
    assert "c_broken.wav" in err and "real-time factor" in err
    rows = {
        Path(r["audio_filepath"]).name: r for r in map(json.loads, out.read_text().splitlines())
    }
    assert set(rows) == {"a_mono16k.wav", "b_stereo44k.wav"}
    # The 44.1 kHz stereo copy is mixed down and resampled back to (nearly) the same audio.
    a, b = load_audio(audio_dir / "a_mono16k.wav"), load_audio(audio_dir / "b_stereo44k.wav")
    n = min(len(a), len(b))
    assert abs(len(a) - len(b)) <= 1 and (a[:n] - b[:n]).norm() < 0.05 * a.norm()
    assert rows["b_stereo44k.wav"]["duration"] == pytest.approx(
        rows["a_mono16k.wav"]["duration"], abs=1e-3
    )
    assert rows["b_stereo44k.wav"]["text"] == rows["a_mono16k.wav"]["text"]

    assert (
        transcribe.main(
            [
                str(tiny_run / "latest.pt"),
                str(tiny_corpus / "valid.jsonl"),
                "--method",
                "joint",
                "--beam_size",
                "3",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == len(read_manifest(tiny_corpus / "valid.jsonl"))
    assert all("\t" in line for line in printed)


def test_a_too_short_file_fails_alone(tiny_run, audio_dir, tmp_path, capsys):
    """0.04 s is under what the encoder's subsampling takes: that file is an error, the other is
    transcribed."""
    wav, sr = sf.read(audio_dir / "a_mono16k.wav", dtype="float32")
    tiny = tmp_path / "tiny.wav"
    sf.write(tiny, wav[:round(0.04 * sr)], sr)
    # alone it made the convolutions raise; batched, it came out as ""
    for batch_size in ("1", "8"):
        assert (
            transcribe.main(
                [
                    str(tiny_run / "latest.pt"),
                    str(audio_dir / "a_mono16k.wav"),
                    str(tiny),
                    "--batch_size",
                    batch_size,
                ]
            )
            == 1
        )
        out = capsys.readouterr()
        [line] = out.out.splitlines()
        path, text = line.split("\t")
        assert path == str(audio_dir / "a_mono16k.wav") and text.strip()
        assert f"{tiny}: audio too short (0.040 s; the model needs at least 0.060 s)" in out.err
        assert "1 of 2 files" in out.err and "Traceback" not in out.err


def test_evaluate_writes_consistent_results_and_report(tiny_run, tiny_corpus, tmp_path, capsys):
    results, report = tmp_path / "r.jsonl", tmp_path / "r.md"
    assert (
        evaluate.main(
            [
                str(tiny_run / "latest.pt"),
                str(tiny_corpus / "valid.jsonl"),
                "--method",
                "rescore",
                "--output",
                str(results),
                "--report",
                str(report),
                "--worst",
                "3",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(rows) == len(read_manifest(tiny_corpus / "valid.jsonl"))
    errors = words = 0
    for r in rows:
        w, _ = score(r["reference"], r["hypothesis"])
        assert (w.substitutions, w.deletions, w.insertions) == (
            r["words"]["substitutions"], r["words"]["deletions"], r["words"]["insertions"])
        errors, words = errors + w.errors, words + w.length
    assert f"WER {100 * errors / words:.2f}%" in printed
    text = report.read_text()
    assert "| words |" in text and "| characters |" in text and "worst utterances" in text


def test_evaluate_names_unreadable_rows_and_scores_the_rest(
    tiny_run, tiny_corpus, tmp_path, capsys
):
    rows = [row for _, row in read_manifest(tiny_corpus / "valid.jsonl")][:3]
    rows[1] = {**rows[1], "audio_filepath": "no_such.wav"}
    manifest = tiny_corpus / "partly_broken.jsonl"
    manifest.write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8"
    )
    assert evaluate.main([str(tiny_run / "latest.pt"), str(manifest), "--method", "greedy"]) == 1
    out = capsys.readouterr()
    assert (
        "2 utterances" in out.out
        and "partly_broken.jsonl:2" in out.err
        and "no_such.wav" in out.err
    )


def test_a_missing_file_is_said_once_and_no_speed_without_audio(tiny_run, tmp_path, capsys):
    missing = tmp_path / "gone.wav"
    assert transcribe.main([str(tiny_run / "latest.pt"), str(missing), "--method", "greedy"]) == 1
    err = capsys.readouterr().err
    assert err.count(str(missing)) == 1 and f"{missing}: audio file missing" in err
    assert "System error" not in err and "nan" not in err and "real-time factor" not in err
    assert "0 of 1 files (0.0 s of audio) transcribed" in err

    manifest = tmp_path / "gone.jsonl"
    manifest.write_text(
        json.dumps({"audio_filepath": "gone.wav", "duration": 1.0, "text": "हांव"}) + "\n"
    )
    assert evaluate.main([str(tiny_run / "latest.pt"), str(manifest), "--method", "greedy"]) == 1
    out = capsys.readouterr()
    assert f"no utterance of {manifest} could be scored" in out.out and "nan" not in out.out
    assert out.err.count("gone.wav") == 1 and "gone.wav: audio file missing" in out.err


def test_a_header_with_an_absurd_sample_rate_is_refused_before_resampling(
    tmp_path, monkeypatch, capsys
):
    """A wav header is four bytes anyone can write: 2147483647 Hz made torchaudio's resampler ask
    for 8.6 GB, 44101 Hz (an odd ratio to 16 kHz) for 2.8 GB. Such a file is named with why, before
    any
    resampling (the resampler is watched), and the others are transcribed, batched and streamed."""
    tokenizer = train_tokenizer(["हांव घरा वता"], vocab_size=16, model_type="char")
    cfg = model_config_from_preset(
        "tiny", vocab_size=tokenizer.vocab_size, causal_conv=True, dynamic_chunk=True, max_chunk=4
    )
    checkpoint = save_checkpoint(
        {
            "model_config": dataclasses.asdict(cfg),
            "model": ASRModel(cfg).state_dict(),
            "tokenizer": tokenizer.model_proto,
        },
        tmp_path / "model.pt",
    )
    good = tmp_path / "good.wav"
    sf.write(
        good,
        0.1 * np.random.default_rng(0).standard_normal(8000).astype(np.float32),
        8000,
        subtype="PCM_16",
    )
    lying = {}
    for rate in (2 ** 31 - 1, 44101):
        header = bytearray(good.read_bytes())
        header[24:28] = rate.to_bytes(4, "little")  # the fmt chunk's sample rate
        lying[rate] = tmp_path / f"rate_{rate}.wav"
        lying[rate].write_bytes(bytes(header))
    real_resample, rates = torchaudio.functional.resample, []

    def watched(wav, orig_freq, new_freq, *args, **kwargs):
        rates.append(orig_freq)
        assert orig_freq == 8000, f"resampling from {orig_freq} Hz"  # without the check: gigabytes
        return real_resample(wav, orig_freq, new_freq, *args, **kwargs)

    monkeypatch.setattr(torchaudio.functional, "resample", watched)
    # batched files (Recognizer.transcribe), streams (transcribe_long)
    for flags in ([], ["--chunk_size", "4"]):
        assert (
            transcribe.main(
                [
                    str(checkpoint),
                    str(lying[2**31 - 1]),
                    str(good),
                    str(lying[44101]),
                    "--method",
                    "greedy",
                    *flags,
                ]
            )
            == 1
        )
        out = capsys.readouterr()
        assert str(good) in out.out and "rate_" not in out.out
        assert "1 of 3 files" in out.err and "Traceback" not in out.err
        assert (
            f"{lying[2 ** 31 - 1]}: sample rate unsupported (a sample rate of 2147483647 Hz:"
            " konkanivani takes 8000 to 192000 Hz)"
            in out.err
        )
        assert (
            f"{lying[44101]}: sample rate unsupported (a sample rate of 44101 Hz: too odd a ratio"
            in out.err
        )
        assert len([line for line in out.err.splitlines() if "rate_" in line]) == 2  # one line each
    assert rates and set(rates) == {8000}


@pytest.mark.parametrize("damage", ["truncated", "other_version", "not_a_checkpoint"])
def test_bad_checkpoints_give_a_clear_error(tiny_run, audio_dir, tmp_path, capsys, damage):
    bad = tmp_path / "bad.pt"
    good = (tiny_run / "latest.pt").read_bytes()
    if damage == "truncated":
        bad.write_bytes(good[:len(good) // 2])
    elif damage == "other_version":
        state = load_checkpoint(tiny_run / "latest.pt")
        torch.save({**state, "format_version": 99}, bad)
    else:
        torch.save({"weights": torch.zeros(3)}, bad)
    manifest = tmp_path / "x.jsonl"
    manifest.write_text("")
    for main in (lambda: transcribe.main([str(bad), str(audio_dir / "a_mono16k.wav")]),
                 lambda: evaluate.main([str(bad), str(manifest)])):
        assert main() == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and str(bad) in err and "Traceback" not in err


def test_averaging_identical_checkpoints_returns_the_same_weights(tiny_run, tmp_path):
    latest = tiny_run / "latest.pt"
    assert (
        average_checkpoints.main(
            ["--inputs", str(latest), str(latest), "--output", str(tmp_path / "a.pt")]
        )
        == 0
    )
    original, averaged = (
        load_checkpoint(latest)["model"],
        load_checkpoint(tmp_path / "a.pt")["model"],
    )
    assert original.keys() == averaged.keys()
    for name in original:
        assert torch.equal(original[name], averaged[name]), name


def test_average_last_and_best_of_a_run(tiny_run, tiny_corpus, tmp_path, capsys):
    assert (
        average_checkpoints.main(
            [str(tiny_run), "--last", "3", "--output", str(tmp_path / "last.pt")]
        )
        == 0
    )
    assert (
        average_checkpoints.main(
            [str(tiny_run), "--best", "2", "--output", str(tmp_path / "best.pt")]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert printed.count("step_") == 5
    last = load_checkpoint(tmp_path / "last.pt")
    assert len(last["averaged_from"]) == 3 and "optimizer" not in last
    # The averaged model decodes, and cannot be resumed by mistake.
    assert (
        evaluate.main(
            [str(tmp_path / "best.pt"), str(tiny_corpus / "valid.jsonl"), "--method", "greedy"]
        )
        == 0
    )
    cfg = TrainConfig(
        train_manifest=str(tiny_corpus / "train.jsonl"),
        valid_manifest=str(tiny_corpus / "valid.jsonl"),
        output_dir=str(tmp_path / "resume"),
        resume=str(tmp_path / "last.pt"),
        progress=False,
    )
    with pytest.raises(CheckpointError, match="weights only"):
        train(cfg)


def test_checkpoints_of_different_models_are_not_averaged(tiny_run, tmp_path):
    state = load_checkpoint(tiny_run / "latest.pt")
    other = tmp_path / "other.pt"
    save_checkpoint({**state, "model_config": {**state["model_config"], "d_model": 64}}, other)
    with pytest.raises(CheckpointError, match="differs"):
        average_checkpoints.average_checkpoints([tiny_run / "latest.pt", other])


def test_a_step_file_from_before_a_model_field_averages_with_one_after(tiny_run, tmp_path):
    """A run resumed across an upgrade: its older step files lack the fields added since
    (checkpoint.ADDED_OFF), which read as off, as the newer ones say."""
    from konkanivani.checkpoint import ADDED_OFF

    state = load_checkpoint(tiny_run / "latest.pt")
    older = tmp_path / "older.pt"
    config = {k: v for k, v in state["model_config"].items() if k not in ADDED_OFF}
    save_checkpoint({**state, "model_config": config}, older)
    averaged = average_checkpoints.average_checkpoints([older, tiny_run / "latest.pt"])
    for name, tensor in state["model"].items():
        torch.testing.assert_close(averaged["model"][name], tensor)


@pytest.fixture(scope="module")
def streaming_run(tiny_corpus, tmp_path_factory):
    """A short run of the tiny preset trained for streaming, through the trainer's command line."""
    from tiny_args import tiny_args

    from konkanivani.cli import train as train_cli

    out = tmp_path_factory.mktemp("streaming_run")
    assert (
        train_cli.main(
            tiny_args(
                tiny_corpus,
                out,
                "--dynamic_chunk",
                "--causal_conv",
                "--max_chunk",
                "8",
                "--max_steps",
                "120",
            )
        )
        == 0
    )
    return out


def test_a_streaming_run_streams_real_speech_as_it_decodes_it_offline(
    streaming_run, tiny_corpus, tmp_path, capsys
):
    """On espeak-ng speech: the stream's final text is offline rescoring under the same chunk mask
    (an endpoint-free stream), and the command line prints partial results and timed segments."""
    from konkanivani.decoding.recognizer import Recognizer
    from konkanivani.decoding.search import attention_rescoring

    rec = Recognizer.from_checkpoint(streaming_run / "latest.pt")
    clips = [
        tiny_corpus / row["audio_filepath"]
        for _, row in read_manifest(tiny_corpus / "valid.jsonl")[:3]
    ]
    texts = []
    for clip in clips:
        wav = load_audio(clip)
        [final] = [
            r
            for r in rec.stream_results(wav.split(1600), chunk_size=4, endpoint_ms=0)
            if r.is_final
        ]
        feats = rec.frontend(wav)[None]
        with torch.inference_mode():
            enc, lens = rec.model.encode(feats, torch.tensor([feats.shape[1]]), chunk_size=4)
            offline = attention_rescoring(rec.model, enc, lens, beam_size=10)[0].tokens
        assert final.text == rec.tokenizer.decode(offline)
        texts.append(final.text)
    assert any(texts)  # compared on text, not on silence
    assert (
        transcribe.main(
            [str(streaming_run / "latest.pt"), str(clips[0]), "--chunk_size", "4", "--stream"]
        )
        == 0
    )
    out = capsys.readouterr()
    assert all(len(line.split("\t")) == 4 for line in out.out.splitlines())
    assert " … " in out.err and "streamed in chunks of 4 frames" in out.err


def test_a_minute_of_speech_in_segments_through_both_kinds_of_checkpoint(
    streaming_run, tiny_run, tiny_corpus, tmp_path
):
    rows = [row for _, row in read_manifest(tiny_corpus / "train.jsonl")]
    pause = np.zeros(16000, dtype=np.float32)
    wavs, seconds = [], 0.0
    for row in rows:
        wavs += [load_audio(tiny_corpus / row["audio_filepath"]).numpy(), pause]
        seconds += len(wavs[-2]) / 16000 + 1
        if seconds > 60:
            break
    sf.write(tmp_path / "minute.wav", np.concatenate(wavs), 16000)
    for checkpoint, flags in (
        (streaming_run / "latest.pt", ["--chunk_size", "8"]),
        (tiny_run / "latest.pt", []),
    ):
        out = tmp_path / "segments.jsonl"
        assert (
            transcribe.main(
                [str(checkpoint), str(tmp_path / "minute.wav"), *flags, "--output", str(out)]
            )
            == 0
        )
        segments = [json.loads(line) for line in out.read_text().splitlines()]
        times = [t for s in segments for t in (s["start"], s["end"])]
        assert len(segments) >= 3 and times == sorted(times) and times[-1] <= seconds + 0.01
