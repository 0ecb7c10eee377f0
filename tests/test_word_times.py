"""Word times and probabilities (decoding/alignment.py), subtitles (decoding/subtitles.py) and
konkanivani-transcribe --format. The alignment on made-up CTC output and on a tiny model that learns
tone "speech" in the test (tests/tone_speech.py: every word's start and end is known to the sample),
offline, in a stream and in the windows of a long file; the subtitles parsed back by the libraries
that wrote them; each --format and the checks of its outputs. Counted, never timed."""
import hashlib
import json
import statistics

import numpy as np
import pytest
import soundfile as sf
import srt
import torch
import webvtt
from hypothesis import given, settings
from hypothesis import strategies as st
from serve_helpers import save_recognizer, train_model
from tone_speech import SENTENCES, speech

from konkanivani.cli import transcribe
from konkanivani.data.frames import SAMPLE_RATE
from konkanivani.data.tokenizer import train_tokenizer
from konkanivani.decoding import alignment
from konkanivani.decoding.alignment import (
    FRAME_SECONDS,
    TokenSpan,
    Word,
    align_tokens,
    align_words,
    words_of_spans,
)
from konkanivani.decoding.streaming import Result
from konkanivani.decoding.subtitles import cues, segment_of, subtitles, to_srt, to_vtt, width

PIECE = SAMPLE_RATE // 10  # 100 ms


def known_words(text: str) -> list[tuple[float, float]]:
    """Each word's start and end in ``speech(text)`` (seconds): 0.3 s of silence, 150 ms a letter,
    100 ms between words."""
    out, at = [], 0.3
    for word in text.split():
        out.append((at, at + 0.15 * len(word)))
        at += 0.15 * len(word) + 0.1
    return out


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(SENTENCES, vocab_size=16, model_type="char")


@pytest.fixture(scope="module")
def tone_words_model():
    """A tiny streaming model that has learned SENTENCES, alone and in a row (150 steps, chunks of
    1-8 frames and full context, causal convolutions)."""
    # each sentence alone, and all four one after another with pauses between, each first once
    # (as a long file's windows hold them)
    pause = torch.zeros(SAMPLE_RATE // 2)
    rows = [SENTENCES[k:] + SENTENCES[:k] for k in range(len(SENTENCES))]  # each after each
    alone = [speech(s, seed=i) for i, s in enumerate(SENTENCES)]
    joined = [torch.cat([x for i in range(len(alone)) for x in (alone[(k + i) % len(alone)],
                                                                pause)])
              for k in range(len(alone))]
    return train_model(alone + joined, [*SENTENCES, *(" ".join(row) for row in rows)], True,
                       steps=150)


@pytest.fixture(scope="module")
def rec(tone_words_model):
    return tone_words_model


@pytest.fixture(scope="module")
def checkpoint(rec, tmp_path_factory):
    return save_recognizer(rec, tmp_path_factory.mktemp("model") / "tone.pt")


def check_words(words: list[Word], text: str, seconds: float) -> None:
    """The words spell ``text``, in order, each lasting, none overlapping, all inside the audio,
    each with a probability in [0, 1]."""
    assert [w.text for w in words] == text.split()
    times = [t for w in words for t in (w.start, w.end)]
    assert times == sorted(times) and all(w.start < w.end for w in words)
    assert 0 <= times[0] and times[-1] <= seconds
    assert all(0.0 <= w.probability <= 1.0 for w in words)


def boundary_errors(words: list[Word], known: list[tuple[float, float]], offset: float = 0.0
                    ) -> list[float]:
    return [abs(got - (want + offset)) for w, (start, end) in zip(words, known)
            for got, want in ((w.start, start), (w.end, end))]


# The alignment itself, on CTC output made by hand.

def made_log_probs(frames: int, vocab: int, spikes: dict[int, tuple[int, float]]) -> torch.Tensor:
    """Log-probabilities ``(frames, vocab)``: blank (id 0) at 0.9 but where ``spikes`` puts a token
    at a probability (frame -> (token, p)); the rest spread over the other ids."""
    probs = torch.full((frames, vocab), 0.1 / (vocab - 1))
    probs[:, 0] = 0.9
    for frame, (token, p) in spikes.items():
        probs[frame] = (1 - p) / (vocab - 1)
        probs[frame, token] = p
    return probs.log()


def test_align_tokens_finds_each_tokens_frames_and_its_posterior():
    log_probs = made_log_probs(12, 6, {2: (3, 0.8), 5: (4, 0.7), 6: (4, 0.5), 9: (3, 0.6)})
    spans = align_tokens(log_probs, [3, 4, 3])
    assert [(s.token, s.start, s.end) for s in spans] == [(3, 2, 3), (4, 5, 7), (3, 9, 10)]
    assert [s.probability for s in spans] == pytest.approx([0.8, 0.6, 0.6])
    # CTC needs a frame per token and a blank between equal ones: too many tokens are no alignment
    assert align_tokens(log_probs[:2], [3, 3]) is None
    assert align_tokens(log_probs[:3], [3, 4, 5, 3]) is None
    assert align_tokens(log_probs, []) == []
    assert align_words(None, [3] * 13, log_probs) == []


def test_words_are_the_pieces_between_word_marks_timed_by_their_frames(tokenizer):
    ids = tokenizer.encode("abc de")  # "▁ a b c ▁ d e": the "▁" alone is no part of a word
    frames = [1, 3, 4, 6, 8, 10, 13]
    probs = [0.1, 0.9, 0.5, 0.8, 0.05, 0.7, 0.95]
    spans = [TokenSpan(t, f, f + 1, p) for t, f, p in zip(ids, frames, probs)]
    words = words_of_spans(tokenizer, spans, offset=2.0)
    shift_s, shift_e = alignment.START_SHIFT, alignment.END_SHIFT
    assert words == [
        Word("abc", round(2.0 + 3 * FRAME_SECONDS + shift_s, 3),
             round(2.0 + 7 * FRAME_SECONDS + shift_e, 3), 0.5),
        Word("de", round(2.0 + 10 * FRAME_SECONDS + shift_s, 3),
             round(2.0 + 14 * FRAME_SECONDS + shift_e, 3), 0.7),
    ]
    # the end of the audio bounds the last word
    [*_, last] = words_of_spans(tokenizer, spans, offset=2.0, duration=0.5)
    assert last.end == 2.5 and last.start < last.end


@settings(max_examples=200, deadline=None)
@given(gaps=st.lists(st.integers(0, 4), min_size=1, max_size=12),
       widths=st.lists(st.integers(1, 3), min_size=12, max_size=12),
       probs=st.lists(st.floats(0, 1), min_size=12, max_size=12),
       shift_s=st.floats(-0.2, 0.2), shift_e=st.floats(-0.2, 0.2),
       offset=st.floats(0, 100), spare=st.integers(0, 3))
def test_shifted_words_keep_their_order_and_the_audio(tokenizer, gaps, widths, probs, shift_s,
                                                      shift_e, offset, spare):
    """Whatever the shifts, the words stay in order, never overlap, each lasts, all inside the
    audio, with probabilities in [0, 1]."""
    space, letter, *_ = tokenizer.encode("a b")  # "▁ a ▁ b"
    spans, at = [], 0
    for gap, w, p in zip(gaps, widths, probs):
        at += gap
        spans.append(TokenSpan(space, at, at + 1, 0.5))
        spans.append(TokenSpan(letter, at + 1, at + 1 + w, p))
        at += 1 + w
    seconds = (at + spare) * FRAME_SECONDS
    old = alignment.START_SHIFT, alignment.END_SHIFT
    try:
        alignment.START_SHIFT, alignment.END_SHIFT = shift_s, shift_e
        words = words_of_spans(tokenizer, spans, offset, seconds)
    finally:
        alignment.START_SHIFT, alignment.END_SHIFT = old
    assert len(words) == len(gaps)
    times = [t for w in words for t in (w.start, w.end)]
    assert times == sorted(times) and all(w.start < w.end for w in words)
    assert round(offset * 1000) <= round(times[0] * 1000)
    assert round(times[-1] * 1000) <= round((offset + seconds) * 1000)
    assert [w.probability for w in words] == [round(p, 3) for p in probs[:len(gaps)]]


# On a model: offline, in a stream, in the windows of a long file.

def test_offline_words_find_the_known_word_boundaries(rec, tmp_path):
    paths, errors = [], []
    for i, text in enumerate(SENTENCES):
        paths.append(tmp_path / f"{i}.wav")
        sf.write(paths[-1], speech(text, seed=10 + i).numpy(), SAMPLE_RATE)
    for tr, text in zip(rec.transcribe(paths, method="rescore"), SENTENCES):
        assert tr.text == text
        check_words(tr.words, text, tr.duration)
        errors += boundary_errors(tr.words, known_words(text))
    # the target on the tone "speech": a median error within 80 ms, none over 200 ms
    assert statistics.median(errors) <= 0.08 and max(errors) <= 0.2
    # the same words through decode_results, and decode_waveforms' texts as before
    wavs = [speech(text, seed=10 + i) for i, text in enumerate(SENTENCES)]
    results = rec.decode_results(wavs, method="rescore")
    assert [r.text for r in results] == rec.decode_waveforms(wavs, method="rescore") == SENTENCES
    # the files hold 16-bit samples: the same words and times, probabilities within a rounding
    from_files = [tr.words for tr in rec.transcribe(paths, method="rescore")]
    for mine, theirs in zip((r.words for r in results), from_files):
        assert [(w.text, w.start, w.end) for w in mine] == [(w.text, w.start, w.end)
                                                             for w in theirs]
        assert [w.probability for w in mine] == pytest.approx([w.probability for w in theirs],
                                                              abs=0.005)
    assert all(r.start == r.words[0].start and r.end == r.words[-1].end for r in results)


def test_a_streams_final_words_are_aligned_with_probabilities(rec):
    text = SENTENCES[3]
    wav = torch.cat([speech(text, seed=4), torch.zeros(SAMPLE_RATE)])
    results = list(rec.stream_results(wav.split(PIECE), chunk_size=4))
    partials, [final] = ([r for r in results if not r.is_final],
                         [r for r in results if r.is_final])
    assert final.text == text
    check_words(final.words, text, len(wav) / SAMPLE_RATE)
    assert statistics.median(boundary_errors(final.words, known_words(text))) <= 0.08
    # partial results still time their words by the frame where each token peaked
    assert any(r.words for r in partials)
    assert all(w.probability is None for r in partials for w in r.words)


def test_a_long_files_windows_time_their_words_from_the_files_start(rec, tmp_path):
    """Over 20 s, decoded in windows cut at pauses: each window's words are where they were said."""
    pause = torch.zeros(SAMPLE_RATE // 2)
    parts, known, texts, at = [], [], [], 0.0
    while at < 45:
        text = SENTENCES[len(texts) % len(SENTENCES)]
        wav = speech(text, seed=len(texts))
        known += known_words(text)
        known[len(known) - len(text.split()):] = [
            (s + at, e + at) for s, e in known[len(known) - len(text.split()):]]
        parts += [wav, pause]
        texts.append(text)
        at += (len(wav) + len(pause)) / SAMPLE_RATE
    path = tmp_path / "long.wav"
    sf.write(path, torch.cat(parts).numpy(), SAMPLE_RATE)
    results = list(rec.transcribe_long(path, method="rescore"))
    assert len(results) >= 3
    said = " ".join(r.text for r in results)
    # the letters all there; the tiny model may run two words of a window together
    assert said.replace(" ", "") == "".join(texts).replace(" ", "")
    assert said.split() == " ".join(texts).split() or len(said.split()) >= 0.95 * len(known)
    words = [w for r in results for w in r.words]
    check_words(words, said, at)
    assert all(r.start <= w.start and w.end <= r.end for r in results for w in r.words)
    # each word's start and end against the known one that starts or ends at the same letter
    starts, ends = _letter_times(" ".join(texts).split(), known)
    got_starts, got_ends = _letter_times([w.text for w in words],
                                         [(w.start, w.end) for w in words])
    errors = [abs(t - starts[k]) for k, t in got_starts.items() if k in starts]
    errors += [abs(t - ends[k]) for k, t in got_ends.items() if k in ends]
    assert len(errors) >= 1.8 * len(known)
    assert statistics.median(errors) <= 0.08


def _letter_times(words: list[str], times: list[tuple[float, float]]
                  ) -> tuple[dict[int, float], dict[int, float]]:
    """The start of each word keyed by its first letter's place in the words run together, and its
    end by its last letter's."""
    starts, ends, at = {}, {}, 0
    for word, (start, end) in zip(words, times):
        starts[at], ends[at + len(word)] = start, end
        at += len(word)
    return starts, ends


# Subtitles.

def timed(text: str, start: float = 0.0, step: float = 0.5, length: float = 0.4) -> list[Word]:
    return [Word(w, round(start + i * step, 3), round(start + i * step + length, 3), 0.9)
            for i, w in enumerate(text.split())]


def test_long_segments_are_cut_into_cues_of_two_lines_of_42_places_or_6_seconds():
    words = timed(" ".join(f"word{i:02d}" for i in range(30)))  # 6 places a word, 0.5 s apart
    [*made] = cues([Result(" ".join(w.text for w in words), True, 0.0, 15.0, words)])
    assert [len(c.lines) for c in made] == [2, 2, 1]
    assert all(width(line) <= 42 for c in made for line in c.lines)
    assert all(c.end - c.start <= 6.0 for c in made)
    assert " ".join(" ".join(c.lines) for c in made) == " ".join(w.text for w in words)
    # twelve words a cue (two lines of six), each cue within 6 s
    assert [(c.start, c.end) for c in made] == [(0.0, 5.9), (6.0, 11.9), (12.0, 14.9)]
    # a cue of few words is cut by its duration instead
    slow = timed("a b c d e f", step=2.0, length=1.5)
    assert [c.text for c in cues([Result("a b c d e f", True, 0, 12, slow)])] == [
        "a b c", "d e f"]
    # and at a pause over a second
    paused = timed("a b", step=0.5) + timed("c d", start=3.0)
    assert [c.text for c in cues([Result("a b c d", True, 0, 4, paused)])] == ["a b", "c d"]


def test_a_vowel_sign_takes_no_place_on_a_line():
    # the letters count, their vowel signs and viramas (combining marks) do not
    assert width("पणजी") == 3 and width("क्षेत्र") == 4 and width("abc") == 3


def test_segments_without_words_or_text():
    long = " ".join(["शब्द"] * 20)
    made = cues([Result("", True, 0, 1), Result(long, True, 1.0, 9.0)])
    assert len(made) == 1 and (made[0].start, made[0].end) == (1.0, 9.0)
    assert " ".join(made[0].lines) == long and all(width(x) <= 42 for x in made[0].lines)
    assert segment_of("", [], 2.5).end == 2.5
    with pytest.raises(ValueError, match="srt, vtt"):
        subtitles([], "ass")


def test_subtitles_parse_back_with_the_libraries_that_wrote_them():
    first = timed("हांव घरा वता", start=0.25)
    second = timed("तूं कितें करता आमी पणजेक गेलें", start=61.5, step=1.2)
    segments = [Result("हांव घरा वता", True, 0.25, 1.65, first),
                Result(" ".join(w.text for w in second), True, 61.5, 67.9, second)]
    made = cues(segments)
    parsed = list(srt.parse(to_srt(segments)))
    assert [(s.start.total_seconds(), s.end.total_seconds(), s.content) for s in parsed] == [
        (c.start, c.end, c.text) for c in made]
    assert [s.index for s in parsed] == list(range(1, len(made) + 1))
    vtt = webvtt.from_string(to_vtt(segments))
    assert [(c.start, c.end, c.text) for c in vtt] == [
        ("00:00:00.250", "00:00:01.650", "हांव घरा वता"),
        *[(f"00:01:{c.start - 60:06.3f}", f"00:01:{c.end - 60:06.3f}", c.text)
          for c in made[1:]]]
    assert subtitles(segments, "srt") == to_srt(segments)


# konkanivani-transcribe --format.

@pytest.fixture
def clips(tmp_path):
    """CLIPS/{a,b}.wav and CLIPS/sub/a.wav: three tone sentences."""
    root = tmp_path / "clips"
    (root / "sub").mkdir(parents=True)
    for i, name in enumerate(["a.wav", "b.wav", "sub/a.wav"]):
        sf.write(root / name, speech(SENTENCES[i], seed=20 + i).numpy(), SAMPLE_RATE)
    return root


def digests(root):
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_transcribe_format_text_and_json(checkpoint, clips, tmp_path, capsys):
    ckpt, a = str(checkpoint), str(clips / "a.wav")
    # the default, as before: path and text printed
    assert transcribe.main([ckpt, a, "--method", "rescore"]) == 0
    assert capsys.readouterr().out == f"{a}\t{SENTENCES[0]}\n"
    assert transcribe.main([ckpt, a, "--method", "rescore", "--format", "text"]) == 0
    assert capsys.readouterr().out == f"{a}\t{SENTENCES[0]}\n"
    assert transcribe.main([ckpt, a, "--method", "rescore", "--format", "json"]) == 0
    [row] = map(json.loads, capsys.readouterr().out.splitlines())
    assert row["audio_filepath"] == a and row["text"] == SENTENCES[0]
    assert [w["word"] for w in row["words"]] == SENTENCES[0].split()
    assert all(set(w) == {"word", "start", "end", "probability"} for w in row["words"])
    # --output without --format: JSON rows, as before (now with the words)
    out = tmp_path / "t.jsonl"
    assert transcribe.main([ckpt, str(clips), "--method", "rescore", "--output", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["text"] for r in rows] == SENTENCES[:3] and all(r["words"] for r in rows)
    # --format text into a file: the printed lines
    assert transcribe.main([ckpt, a, "--method", "rescore", "--format", "text", "--output",
                            str(out)]) == 0
    assert out.read_text(encoding="utf-8") == f"{a}\t{SENTENCES[0]}\n"


def test_transcribe_format_srt_and_vtt(checkpoint, clips, tmp_path, capsys):
    ckpt = str(checkpoint)
    # one input: printed, or written to --output FILE
    assert transcribe.main([ckpt, str(clips / "a.wav"), "--method", "rescore", "--format",
                            "srt"]) == 0
    [cue] = srt.parse(capsys.readouterr().out)
    assert cue.content == SENTENCES[0]
    assert cue.start.total_seconds() == pytest.approx(0.3, abs=0.08)
    one = tmp_path / "one.vtt"
    assert transcribe.main([ckpt, str(clips / "b.wav"), "--method", "rescore", "--format", "vtt",
                            "--output", str(one)]) == 0
    assert [c.text for c in webvtt.read(one)] == [SENTENCES[1]]
    # several: one file per input in the --output folder, named after its path in the input folder
    before = digests(clips)
    assert transcribe.main([ckpt, str(clips), "--method", "rescore", "--format", "vtt",
                            "--output", str(tmp_path / "subs")]) == 0
    assert "wrote 3 vtt files in" in capsys.readouterr().err
    for name, text in (("a", SENTENCES[0]), ("b", SENTENCES[1]), ("sub/a", SENTENCES[2])):
        assert [c.text for c in webvtt.read(tmp_path / "subs" / f"{name}.vtt")] == [text]
    # beside the audio is allowed: the inputs stay as they were
    assert transcribe.main([ckpt, str(clips), "--method", "rescore", "--format", "srt",
                            "--output", str(clips)]) == 0
    assert {p: d for p, d in digests(clips).items() if p.suffix == ".wav"} == before
    assert [s.content for s in srt.parse((clips / "sub" / "a.srt").read_text())] == [SENTENCES[2]]
    # through a stream, its segments' cues
    assert transcribe.main([ckpt, str(clips / "a.wav"), "--chunk_size", "4", "--format",
                            "srt"]) == 0
    assert [s.content for s in srt.parse(capsys.readouterr().out)] == [SENTENCES[0]]


@pytest.mark.parametrize("flags, message", [
    (["CLIPS", "--format", "srt"],
     "--format srt writes a file per input: give --output FOLDER for the 3 inputs"),
    (["CLIPS", "--format", "vtt", "--output", "CLIPS/a.wav"],
     "--output CLIPS/a.wav is a file: --format vtt writes a file per input, into a folder"),
    (["CLIPS/a.wav", "--format", "srt", "--output", "CLIPS/a.wav"],
     "--output (the srt of CLIPS/a.wav) CLIPS/a.wav is also an input of this command"),
    (["CLIPS/a.wav", "CLIPS/sub/a.wav", "--format", "srt", "--output", "OUT"],
     "OUT/a.srt and --output (the srt of CLIPS/sub/a.wav) OUT/a.srt are the same file"),
])
def test_subtitle_outputs_are_checked_before_decoding(checkpoint, clips, tmp_path, capsys, flags,
                                                      message):
    before = digests(clips)
    argv = [f.replace("CLIPS", str(clips)).replace("OUT", str(tmp_path / "out")) for f in flags]
    with pytest.raises(SystemExit) as stop:
        transcribe.main([str(checkpoint), *argv])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert message.replace("CLIPS", str(clips)).replace("OUT", str(tmp_path / "out")) in err
    assert digests(clips) == before and not (tmp_path / "out").exists()


def test_a_long_files_segments_in_json_and_srt(checkpoint, tmp_path, capsys):
    """Over 30 s: segments, each with its words (JSON) or cues (SRT)."""
    parts = []
    while sum(len(p) for p in parts) < 32 * SAMPLE_RATE:
        parts += [speech(SENTENCES[len(parts) // 2 % 4], seed=len(parts)),
                  torch.zeros(SAMPLE_RATE // 2)]
    path = tmp_path / "long.wav"
    sf.write(path, torch.cat(parts).numpy(), SAMPLE_RATE)
    assert transcribe.main([str(checkpoint), str(path), "--method", "rescore", "--format",
                            "json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) >= 2
    words = [w for r in rows for w in r["words"]]
    assert [w["word"] for w in words] == " ".join(r["text"] for r in rows).split()
    assert all(r["start"] <= w["start"] < w["end"] <= r["end"] for r in rows for w in r["words"])
    assert transcribe.main([str(checkpoint), str(path), "--method", "rescore", "--format",
                            "srt"]) == 0
    subs = list(srt.parse(capsys.readouterr().out))
    assert " ".join(s.content.replace("\n", " ") for s in subs).split() == [
        w["word"] for w in words]
    assert all(np.diff([t.total_seconds() for s in subs for t in (s.start, s.end)]) >= 0)
