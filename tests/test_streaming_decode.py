"""Streaming decoding (decoding/streaming.py) and long recordings: features computed as the audio
comes equal the whole file's, a stream's final text equals offline decoding under the same chunk
mask, partial results follow the search, endpoints split segments, and a long file is read block by
block through either kind of checkpoint. On tiny models that learn four synthetic "sentences" (a
tone per letter) in a few seconds; counted, never timed."""
import json
import logging
import math

import numpy as np
import pytest
import soundfile as sf
import torch
from tone_speech import SENTENCES, speech

from konkanivani.cli import transcribe
from konkanivani.data.audio import Resampler, load_audio, read_blocks, resample
from konkanivani.data.features import LogMel
from konkanivani.data.frames import SAMPLE_RATE
from konkanivani.decoding import recognizer as recognizer_module
from konkanivani.decoding.recognizer import Recognizer
from konkanivani.decoding.search import attention_rescoring, ctc_greedy, ctc_prefix_beam_search
from konkanivani.decoding.streaming import FRAME_SECONDS, StreamingLogMel, quiet_windows

PIECE = SAMPLE_RATE // 10  # 100 ms



def silence(seconds: float, seed: int = 1) -> torch.Tensor:
    return 0.003 * torch.randn(
        round(seconds * SAMPLE_RATE), generator=torch.Generator().manual_seed(seed)
    )


@pytest.fixture(scope="module")
def rec(tone_model):
    """conftest's streaming tone model (120 steps, chunks of 1-8 frames and full context)."""
    return tone_model


@pytest.fixture(scope="module")
def full_rec(tone_full_model):
    return tone_full_model


def _finals(results):
    return [r for r in results if r.is_final]


# Features and audio as they come.

@pytest.mark.parametrize("piece", [1, 100, 160, 1600, 7777, 10 ** 6])
def test_streamed_features_equal_the_whole_files(piece):
    log_mel = LogMel(80)
    wav = torch.randn(3 * SAMPLE_RATE + 55, generator=torch.Generator().manual_seed(0)) * 0.1
    stream = StreamingLogMel(log_mel)
    frames = [stream.accept(p) for p in wav.split(piece)] + [
        stream.accept(wav[:0]),
        stream.finish(),
    ]
    whole = log_mel(wav)
    assert torch.cat(frames).shape == whole.shape
    assert (torch.cat(frames) - whole).abs().max() <= 1e-5  # the same STFTs; batched otherwise
    # the last one reaches into the end's reflection
    assert len(whole) - sum(len(f) for f in frames[:-1]) == 1


def test_too_few_samples_for_the_reflection_give_no_frames_as_the_whole_file_path_cannot():
    stream = StreamingLogMel(LogMel(80))
    assert len(stream.accept(torch.zeros(200))) == 0 and len(stream.finish()) == 0


@pytest.mark.parametrize("rate", [8000, 22050, 44100])
def test_audio_is_read_and_resampled_block_by_block_as_the_whole_file(rate, tmp_path):
    gen = np.random.default_rng(0)
    stereo = (gen.standard_normal((rate * 3 + 11, 2)) * 0.1).astype(np.float32)
    sf.write(tmp_path / "a.wav", stereo, rate, subtype="FLOAT")
    blocks = list(read_blocks(tmp_path / "a.wav", seconds=0.25))
    assert max(len(b) for b in blocks) <= 0.3 * SAMPLE_RATE
    whole = load_audio(tmp_path / "a.wav")
    assert (
        torch.cat(blocks).shape == whole.shape and (torch.cat(blocks) - whole).abs().max() <= 1e-6
    )

    resampler = Resampler(rate)
    wav = torch.from_numpy(stereo[:, 0])
    pieces = [resampler(p) for p in wav.split(997)] + [resampler.flush()]
    assert (torch.cat(pieces) - resample(wav, rate)).abs().max() <= 1e-6


def test_quiet_windows_cut_long_audio_at_its_pauses():
    loud = 0.3 * torch.sin(torch.arange(17 * SAMPLE_RATE) * 0.3)
    # pauses at 17-17.5 s and 34.5-35 s
    wav = torch.cat([loud, silence(0.5), loud, silence(0.5), loud])
    windows = list(quiet_windows(wav.split(SAMPLE_RATE)))
    assert [first for first, _ in windows] == [0] + [first for first, _ in windows][1:]
    assert torch.equal(torch.cat([w for _, w in windows]), wav)
    cuts = [first / SAMPLE_RATE for first, _ in windows[1:]]
    assert len(cuts) == 2 and 17 <= cuts[0] <= 17.5 and 34.5 <= cuts[1] <= 35
    assert all(len(w) <= 20 * SAMPLE_RATE for _, w in windows)


# A stream against offline decoding under the same chunk mask.

def _offline_enc(rec, wav, chunk, left=-1):
    feats = rec.frontend(wav)[None]
    with torch.inference_mode():
        return rec.model.encode(
            feats, torch.tensor([feats.shape[1]]), chunk_size=chunk, left_chunks=left
        )


@pytest.mark.parametrize("method,left",
                         [("rescore", -1), ("beam", -1), ("rescore", 2), ("greedy", 2)])
def test_a_streams_final_text_equals_offline_decoding_under_the_same_chunk_mask(rec, method, left):
    for i, sentence in enumerate(SENTENCES):
        wav = speech(sentence, seed=i)
        results = list(
            rec.stream_results(
                wav.split(PIECE), chunk_size=4, left_chunks=left, method=method, endpoint_ms=0
            )
        )
        [final] = _finals(results)
        enc, lens = _offline_enc(rec, wav, 4, left)
        with torch.inference_mode():
            if method == "rescore":
                offline = attention_rescoring(rec.model, enc, lens, beam_size=10)[0].tokens
            elif method == "greedy":
                [offline] = ctc_greedy(rec.model.ctc_log_probs(enc), lens)
            else:
                offline = ctc_prefix_beam_search(rec.model.ctc_log_probs(enc)[0], int(lens[0]), 10)[
                    0
                ].tokens
        # greedy may end with the word boundary the best path spells after the last word
        assert final.text == rec.tokenizer.decode(offline)
        assert final.text.rstrip() == sentence


def test_partial_results_come_before_the_final_and_are_the_searchs_best_so_far(rec):
    wav = speech(SENTENCES[3], seed=3)
    results = list(rec.stream_results(wav.split(PIECE), chunk_size=4, endpoint_ms=0))
    assert [r.is_final for r in results] == [False] * (len(results) - 1) + [True]
    enc, lens = _offline_enc(rec, wav, 4)
    with torch.inference_mode():
        log_probs = rec.model.ctc_log_probs(enc)[0]
    partials = results[:-1]
    assert len(partials) == math.ceil(int(lens[0]) / 4)  # one per chunk
    for i, partial in enumerate(partials):  # the prefix beam search over the frames so far
        best = ctc_prefix_beam_search(log_probs, min(4 * (i + 1), int(lens[0])), 10)[0]
        assert partial.text == rec.tokenizer.decode(best.tokens)
    texts = [p.text for p in partials if p.text]
    assert texts and texts[-1] == SENTENCES[3]
    # it only grows here
    assert all(later.startswith(earlier.rstrip()) for earlier, later in zip(texts, texts[1:]))


def test_times_increase_and_lie_inside_the_audio(rec):
    wav = speech(SENTENCES[2], seed=2)
    [final] = _finals(rec.stream_results(wav.split(PIECE), chunk_size=4))
    assert [w.text for w in final.words] == final.text.split() == SENTENCES[2].split()
    times = [t for w in final.words for t in (w.start, w.end)]
    assert times == sorted(times) and all(w.start < w.end for w in final.words)
    assert (
        0.2 <= final.start == final.words[0].start
        and final.end == final.words[-1].end <= len(wav) / SAMPLE_RATE
    )
    # 40 ms frames, moved by the measured shifts (decoding.alignment)
    from konkanivani.decoding.alignment import END_SHIFT, START_SHIFT

    assert all(round((w.start - START_SHIFT) / FRAME_SECONDS, 6) % 1 == 0 for w in final.words)
    assert all(round((w.end - END_SHIFT) / FRAME_SECONDS, 6) % 1 == 0 for w in final.words)


def test_an_endpoint_splits_two_utterances_joined_by_silence(rec):
    first, second = speech(SENTENCES[0], seed=0), speech(SENTENCES[1], seed=1)
    wav = torch.cat([first, silence(1.5), second])
    finals = _finals(rec.stream_results(wav.split(PIECE), chunk_size=4, endpoint_ms=800))
    assert [f.text for f in finals] == SENTENCES[:2]
    assert finals[0].end < (len(first) + 0.8 * SAMPLE_RATE) / SAMPLE_RATE
    assert (
        (len(first) + 1.5 * SAMPLE_RATE) / SAMPLE_RATE
        < finals[1].start
        < finals[1].end
        <= len(wav) / SAMPLE_RATE
    )
    assert len(_finals(rec.stream_results(wav.split(PIECE), chunk_size=4, endpoint_ms=0))) == 1


def test_empty_pieces_silence_and_a_stream_cut_mid_word_each_end_in_a_final(rec):
    def finals(pieces):
        results = list(rec.stream_results(pieces, chunk_size=4))
        assert results and results[-1].is_final
        return _finals(results)

    [nothing] = finals([torch.zeros(0)] * 3)
    assert (nothing.text, nothing.start, nothing.end) == ("", 0.0, 0.0)
    [quiet] = finals(silence(3.0).split(PIECE))
    assert quiet.text == "" and quiet.end == pytest.approx(3.0, abs=0.1)
    wav = speech(SENTENCES[3], seed=3)
    cut = 4800 + 3 * 2400 + 1600 + 1200  # in the middle of "bed"'s b
    [partway] = finals(wav[:cut].split(PIECE))
    assert partway.text.startswith("ace")
    # empty pieces change nothing
    pieces = [p for piece in wav.split(PIECE) for p in (piece, torch.zeros(0))]
    assert [r.text for r in rec.stream_results(pieces, chunk_size=4)] == \
        [r.text for r in rec.stream_results(wav.split(PIECE), chunk_size=4)]


def test_a_stream_at_another_rate_is_resampled_as_it_comes(rec):
    at_8k = resample(speech(SENTENCES[1], seed=1), SAMPLE_RATE, 8000)
    streamed = list(
        rec.stream_results(np.array_split(at_8k.numpy(), 37), chunk_size=4, sample_rate=8000)
    )
    resampled_whole = list(rec.stream_results([resample(at_8k, 8000)], chunk_size=4))
    assert [(r.text, r.is_final, r.end) for r in streamed] == [
        (r.text, r.is_final, r.end) for r in resampled_whole
    ]
    assert streamed[-1].text


def test_bad_streams_and_settings_are_refused_in_one_line(rec, full_rec, caplog):
    with pytest.raises(ValueError, match="not a streaming model .*--causal_conv") as refused:
        full_rec.stream(chunk_size=4)
    assert "\n" not in str(refused.value)
    stream = rec.stream(chunk_size=4)
    for bad, reason in [(torch.zeros(2, 1600), "mono"), (np.zeros(1600, dtype=np.int16), "float"),
                        (torch.full((10,), float("nan")), "NaN")]:
        with pytest.raises(ValueError, match=reason):
            stream.accept(bad)
    stream.finish()
    with pytest.raises(ValueError, match="finished"):
        stream.accept(torch.zeros(10))
    for settings, reason in [
        ({"method": "joint"}, "cannot stream"),
        ({"chunk_size": -1}, "chunk_size"),
        ({"left_chunks": -2}, "left_chunks"),
        ({"endpoint_ms": -1}, "endpoint_ms"),
    ]:
        with pytest.raises(ValueError, match=reason):
            rec.stream(**{"chunk_size": 4, **settings})
    # a recognizer of its own: the session's shared one may have said these warnings already
    fresh = Recognizer(rec.model, rec.tokenizer, rec.device)
    with caplog.at_level(logging.WARNING, logger="konkanivani"):
        for _ in range(2):
            fresh.stream(chunk_size=12, left_chunks=1)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2  # each said once
    assert "chunks of 1 to 8 frames" in warned[0] and "--dynamic_left_chunks" in warned[1]


# The command line, and long recordings.

@pytest.fixture(scope="module")
def checkpoints(tone_checkpoints):
    return tone_checkpoints["streaming"], tone_checkpoints["full"]


def test_transcribe_streams_a_file_with_partials_on_stderr(checkpoints, tmp_path, capsys):
    streaming, full = checkpoints
    wav = tmp_path / "clip.wav"
    sf.write(wav, speech(SENTENCES[3], seed=3).numpy(), SAMPLE_RATE)
    assert transcribe.main([str(streaming), str(wav), "--chunk_size", "4", "--stream"]) == 0
    out = capsys.readouterr()
    [line] = out.out.splitlines()
    path, start, end, text = line.split("\t")
    assert (path, text) == (str(wav), SENTENCES[3]) and 0 < float(start) < float(end) <= 2.5
    partials = [p for p in out.err.splitlines() if " … " in p]
    assert len(partials) >= 3 and partials[-1].endswith(SENTENCES[3])
    assert "streamed in chunks of 4 frames (160 ms)" in out.err

    rows = tmp_path / "rows.jsonl"
    assert (
        transcribe.main([str(streaming), str(wav), "--chunk_size", "4", "--output", str(rows)]) == 0
    )
    [row] = map(json.loads, rows.read_text().splitlines())
    assert row["text"] == SENTENCES[3] and [w["word"] for w in row["words"]] == SENTENCES[3].split()


@pytest.mark.parametrize("flags,message", [
    (["--left_chunks", "2"], "--left_chunks needs --chunk_size"),
    (["--stream"], "--stream needs --chunk_size"),
    (["--chunk_size", "-1"], "--chunk_size must be"),
    (["--chunk_size", "4", "--endpoint_ms", "-5"], "--endpoint_ms must be"),
    (["--chunk_size", "4", "--method", "joint"], "--method joint cannot stream"),
])
def test_bad_streaming_flags_are_one_line_exit_2(checkpoints, tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_:
        transcribe.main([str(checkpoints[0]), str(tmp_path / "a.wav"), *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_a_full_context_checkpoint_refuses_chunk_size_in_one_line(checkpoints, tmp_path, capsys):
    wav = tmp_path / "clip.wav"
    sf.write(wav, speech(SENTENCES[0]).numpy(), SAMPLE_RATE)
    assert transcribe.main([str(checkpoints[1]), str(wav), "--chunk_size", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--chunk_size 4" in err and "not a streaming model" in err and len(err.splitlines()) == 1


def test_evaluate_scores_a_streaming_model_as_it_streams(checkpoints, tmp_path, capsys):
    from konkanivani.cli import evaluate

    streaming, full = checkpoints
    rows = []
    for i, sentence in enumerate(SENTENCES):
        sf.write(tmp_path / f"{i}.wav", speech(sentence, seed=i).numpy(), SAMPLE_RATE)
        rows.append(json.dumps({"audio_filepath": f"{i}.wav", "text": sentence, "duration": 2.0}))
    (tmp_path / "m.jsonl").write_text("\n".join(rows) + "\n")
    out = tmp_path / "hyp.jsonl"
    assert (
        evaluate.main(
            [
                str(streaming),
                str(tmp_path / "m.jsonl"),
                "--method",
                "rescore",
                "--chunk_size",
                "4",
                "--left_chunks",
                "2",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    hyps = [json.loads(line)["hypothesis"] for line in out.read_text().splitlines()]
    rec = Recognizer.from_checkpoint(streaming)
    streamed = [
        _finals(
            rec.stream_results(
                speech(s, seed=i).split(PIECE), chunk_size=4, left_chunks=2, endpoint_ms=0
            )
        )[0].text
        for i, s in enumerate(SENTENCES)
    ]
    assert hyps == streamed
    capsys.readouterr()
    assert evaluate.main([str(full), str(tmp_path / "m.jsonl"), "--chunk_size", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a streaming model" in err and len(err.splitlines()) == 1


@pytest.fixture(scope="module")
def long_file(tmp_path_factory):
    """66 s: the four sentences six times over, 1 s apart, at 44.1 kHz stereo."""
    sentences = SENTENCES * 6
    wav = torch.cat(
        [torch.cat([speech(s, seed=i), silence(1.0, seed=i)]) for i, s in enumerate(sentences)]
    )
    path = tmp_path_factory.mktemp("long") / "long.wav"
    at_44k = resample(wav, SAMPLE_RATE, 44100).numpy()
    sf.write(path, np.stack([at_44k, at_44k], axis=1), 44100, subtype="FLOAT")
    return path, sentences, len(wav) / SAMPLE_RATE


@pytest.fixture
def reads(monkeypatch):
    """The most frames any read of a file asked for; reading a file whole fails."""
    largest = [0]
    read = sf.SoundFile.read

    def counted(self, frames=-1, *args, **kwargs):
        largest[0] = max(largest[0], frames if frames >= 0 else self.frames)
        return read(self, frames, *args, **kwargs)

    def whole(*args, **kwargs):
        raise AssertionError("the long file was read whole")

    monkeypatch.setattr(sf.SoundFile, "read", counted)
    monkeypatch.setattr(recognizer_module, "load_audio", whole)
    return largest


@pytest.mark.parametrize("which", ["streaming", "full"])
def test_a_long_file_is_read_block_by_block_and_transcribed_in_timed_segments(
    checkpoints, long_file, reads, tmp_path, capsys, which
):
    """With a streaming checkpoint through a stream, a segment per sentence; with a full-context one
    in windows cut at pauses, each decoded whole (the tiny model has learned 2 s sentences alone and
    makes little of 20 s windows: compared with decoding the windows of the whole waveform)."""
    path, sentences, seconds = long_file
    checkpoint = checkpoints[0] if which == "streaming" else checkpoints[1]
    flags = ["--chunk_size", "8"] if which == "streaming" else ["--method", "rescore"]
    rows_path = tmp_path / "rows.jsonl"
    assert transcribe.main([str(checkpoint), str(path), *flags, "--output", str(rows_path)]) == 0
    assert 0 < reads[0] <= 44100  # blocks of a second
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
    if which == "streaming":
        assert [r["text"] for r in rows] == sentences
    else:
        whole = Recognizer.from_checkpoint(checkpoint)
        wav = resample(torch.from_numpy(sf.read(path, dtype="float32")[0].mean(1)), 44100)
        windows = [
            (
                whole.decode_waveforms([w], method="rescore")[0],
                round(first / SAMPLE_RATE, 3),
                round((first + len(w)) / SAMPLE_RATE, 3),
            )
            for first, w in quiet_windows(wav.split(SAMPLE_RATE))
        ]
        assert len(windows) >= seconds / 20 and all(end - start <= 20 for _, start, end in windows)
        assert [(r["text"], r["start"], r["end"]) for r in rows] == [w for w in windows if w[0]]
    times = [t for r in rows for t in (r["start"], r["end"])]
    assert times == sorted(times) and 0 <= times[0] and times[-1] <= seconds + 1e-3
    assert f"({seconds:.1f} s of audio)" in capsys.readouterr().err
