"""konkanivani-serve's OpenAI dialect as OpenAI's own Python client meets it: a server started on a
free loopback port with a tiny trained streaming model (serve_helpers), the token as the client's
API key, every response_format and timestamp granularity giving what the offline Recognizer gives
on the same audio, the models list, and refusals in OpenAI's error JSON, which the client raises as
its own exceptions. Counted, never timed (every wait bounded)."""
import io
import json
import math

import numpy as np
import pytest
import soundfile as sf
import srt
import webvtt

for _module in ("starlette", "uvicorn", "multipart", "prometheus_client"):
    pytest.importorskip(
        _module, reason="the serve extra is not installed: pip install 'konkanivani[serve]'"
    )
openai = pytest.importorskip("openai", reason="the dev extra is not installed: pip install openai")

from serve_helpers import (  # noqa: E402
    SlowUpload,
    http,
    http_json,
    multipart,
    served,
    two_segment_clip,
    wait_until,
)
from tone_speech import mixed_speech  # noqa: E402

from konkanivani.data.audio import load_audio  # noqa: E402
from konkanivani.decoding.recognizer import Recognizer  # noqa: E402
from konkanivani.decoding.subtitles import to_srt, to_vtt  # noqa: E402
from konkanivani.serving.openai_api import compression_ratio  # noqa: E402

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NAME = "konkani-tones"
# the tone model learned chunks of 1-8 frames; small limits keep the refusals' tests short
FLAGS = ["--token", TOKEN, "--chunk_size", "8", "--model_name", NAME, "--max_upload_mb", "0.5",
         "--grace_seconds", "3"]


@pytest.fixture(scope="module")
def checkpoint(tone_checkpoints):
    return tone_checkpoints["streaming"]


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """Two tone sentences 1.2 s apart (two segments), as a 16-bit wav."""
    return two_segment_clip(tmp_path_factory.mktemp("openai_clip") / "two.wav")


@pytest.fixture(scope="module")
def offline(checkpoint, clip):
    """The final results the Recognizer gives offline, as the server decodes (rescore, chunk 8)."""
    rec = Recognizer.from_checkpoint(checkpoint)
    finals = [r for r in rec.transcribe_long(clip, method="rescore", chunk_size=8) if r.is_final]
    assert len(finals) == 2 and all(r.text for r in finals)  # compared on two segments of text
    assert all(r.words and all(w.probability for w in r.words) for r in finals)
    return finals


@pytest.fixture(scope="module")
def server(checkpoint):
    with served(checkpoint, *FLAGS) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    # no retries: each refusal is seen once, as the server sent it
    return openai.OpenAI(base_url=server.url + "v1", api_key=TOKEN, max_retries=0, timeout=60)


def _transcribe(client, clip, **kwargs):
    with open(clip, "rb") as f:
        return client.audio.transcriptions.create(model=NAME, file=f, **kwargs)


@pytest.mark.slow
def test_every_response_format_gives_what_the_recognizer_gives_offline(client, clip, offline):
    text = " ".join(r.text for r in offline)
    duration = len(load_audio(clip)) / 16000
    spans = [(r.text, r.start, r.end) for r in offline]
    words = [(w.text, w.start, w.end) for r in offline for w in r.words]

    plain = _transcribe(client, clip)  # json, the default
    assert isinstance(plain, openai.types.audio.Transcription)
    assert plain.text == text
    assert plain.usage.type == "duration" and plain.usage.seconds == pytest.approx(duration, 1e-3)
    assert _transcribe(client, clip, response_format="text") == text + "\n"

    verbose = _transcribe(client, clip, response_format="verbose_json")
    assert isinstance(verbose, openai.types.audio.TranscriptionVerbose)
    assert verbose.text == text and verbose.language == "konkani"
    assert verbose.duration == pytest.approx(duration, abs=1e-3)
    assert verbose.model_extra["task"] == "transcribe"
    assert [(s.text, s.start, s.end) for s in verbose.segments] == spans
    assert verbose.words is None  # segments unless words are asked for, as OpenAI answers
    for i, (segment, result) in enumerate(zip(verbose.segments, offline)):
        assert segment.id == i and segment.seek == round(segment.start * 100)
        assert segment.tokens == [] and segment.temperature == 0.0
        assert segment.compression_ratio == compression_ratio(segment.text) > 0
        # the mean log probability of its words, from the CTC alignment
        logs = [math.log(w.probability) for w in result.words]
        assert segment.avg_logprob == pytest.approx(sum(logs) / len(logs), abs=1e-4)
        assert segment.avg_logprob < 0 and segment.no_speech_prob == 0.0

    only_words = _transcribe(client, clip, response_format="verbose_json",
                             timestamp_granularities=["word"])
    assert [(w.word, w.start, w.end) for w in only_words.words] == words
    assert [w.model_extra["probability"] for w in only_words.words] == [
        pytest.approx(w.probability, abs=1e-4) for r in offline for w in r.words]
    assert only_words.segments is None and only_words.text == text
    both = _transcribe(client, clip, response_format="verbose_json",
                       timestamp_granularities=["word", "segment"])
    assert [(w.word, w.start, w.end) for w in both.words] == words
    assert [(s.text, s.start, s.end) for s in both.segments] == spans

    # subtitles: the cues decoding.subtitles makes of the offline segments, a cue each here
    text_srt = _transcribe(client, clip, response_format="srt")
    assert text_srt == to_srt(offline)
    cues = list(srt.parse(text_srt))
    assert [(c.index, c.content, c.start.total_seconds(), c.end.total_seconds())
            for c in cues] == [(i, t, a, b) for i, (t, a, b) in enumerate(spans, 1)]
    text_vtt = _transcribe(client, clip, response_format="vtt")
    assert text_vtt == to_vtt(offline) and text_vtt.startswith("WEBVTT\n")
    captions = webvtt.from_buffer(io.StringIO(text_vtt))
    assert [(c.text, c.start_time.in_milliseconds() / 1000, c.end_time.in_milliseconds() / 1000)
            for c in captions] == spans


@pytest.mark.slow
def test_the_models_and_the_model_a_request_names(server, client, clip, offline):
    models = client.models.list()
    assert [(m.id, m.object, m.owned_by) for m in models.data] == [(NAME, "model", "konkanivani")]
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("whisper-1")
    assert e.value.code == "model_not_found" and "serves 'konkani-tones'" in e.value.message
    # a request may name any model, and fields this server does not use: the one model answers
    with open(clip, "rb") as f:
        raw = client.audio.transcriptions.with_raw_response.create(
            model="whisper-1", file=("clip.wav", f.read(), "audio/wav"), language="en",
            prompt="abc", temperature=0.4)
    assert raw.parse().text == " ".join(r.text for r in offline)
    note = raw.headers["X-Konkanivani-Note"]
    assert note == "language 'en' ignored: the model transcribes konkani"
    with open(clip, "rb") as f:
        raw = client.audio.transcriptions.with_raw_response.create(model=NAME, file=f,
                                                                   language="kok")
    assert "X-Konkanivani-Note" not in raw.headers
    metrics = http("GET", server.url + "metrics", headers=AUTH)[2].decode()
    assert 'konkanivani_requests_total{code="200",endpoint="/v1/audio/transcriptions"}' in metrics
    assert 'konkanivani_audio_seconds_total{endpoint="/v1/audio/transcriptions"}' in metrics


@pytest.mark.slow
def test_refusals_are_openai_errors_the_client_raises(server, client, clip):
    wrong = openai.OpenAI(base_url=server.url + "v1", api_key="wrong", max_retries=0, timeout=60)
    for call in (lambda: _transcribe(wrong, clip), wrong.models.list):
        with pytest.raises(openai.AuthenticationError) as e:
            call()
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        assert "this server needs its token" in e.value.message

    for kwargs, param, words in (
        ({"file": ("notes.wav", b"RIFF\0\0\0\0WAVEjunk" + bytes(100))}, "file", "audio unreadable"),
        ({"file": ("empty.wav", b"")}, "file", "the field 'file' is empty"),
        ({"response_format": "diarized_json"}, "response_format", "is not one of json, text"),
        ({"response_format": "json", "timestamp_granularities": ["word"]},
         "timestamp_granularities", "need response_format=verbose_json"),
        ({"response_format": "verbose_json", "timestamp_granularities": ["sentence"]},
         "timestamp_granularities", "'sentence' is not one of segment, word"),
        ({"temperature": "warm"}, "temperature", "temperature must be a number"),
    ):
        if "file" not in kwargs:
            kwargs = {"file": clip.read_bytes(), **kwargs}
        with pytest.raises(openai.BadRequestError) as e:
            client.audio.transcriptions.create(model=NAME, **kwargs)
        assert e.value.status_code == 400 and e.value.param == param, e.value.body
        assert words in e.value.message and e.value.type == "invalid_request_error"

    with pytest.raises(openai.APIStatusError) as e:  # over --max_upload_mb 0.5
        client.audio.transcriptions.create(model=NAME, file=("big.wav", bytes(600 * 1024)))
    assert e.value.status_code == 413 and e.value.code == "too_large" and e.value.param == "file"
    flac = io.BytesIO()  # a small file of an hour: refused by its header, before it is decoded
    sf.write(flac, np.zeros(16000 * 3600, np.int16), 16000, format="FLAC")
    with pytest.raises(openai.APIStatusError) as e:
        client.audio.transcriptions.create(model=NAME, file=("hour.flac", flac.getvalue()))
    assert e.value.status_code == 413 and "3600.0 s of audio" in e.value.message

    # without the client: OpenAI's error JSON for requests it would not send
    status, answer = http_json("POST", server.url + "v1/audio/transcriptions", clip.read_bytes(),
                               AUTH)
    assert status == 400 and answer["error"]["param"] == "file"
    assert "multipart/form-data form" in answer["error"]["message"]
    body, headers = multipart("audio", "clip.wav", clip.read_bytes())
    status, answer = http_json("POST", server.url + "v1/audio/transcriptions", body,
                               {**AUTH, **headers})
    assert status == 400 and "needs the file in its field 'file'" in answer["error"]["message"]
    status, answer = http_json("GET", server.url + "v1/audio/transcriptions", None, AUTH)
    assert status == 404 and answer == {"error": {
        "message": "Invalid URL (GET /v1/audio/transcriptions): this server answers POST "
                   "/v1/audio/transcriptions, GET /v1/models and GET /v1/models/{model}",
        "type": "invalid_request_error", "param": None, "code": None}}
    status, answer = http_json("GET", server.url + "v1/models", None, {"Origin": "http://evil"})
    assert status == 403 and answer["error"]["code"] == "origin"
    # /transcribe keeps its own error JSON
    status, answer = http_json("POST", server.url + "transcribe", b"", AUTH)
    assert status == 400 and answer == {"error": "no audio: send the file as the body, or as a "
                                                 "file field of a multipart form"}

    # two uploads of this client trickle (a byte every 0.5 s): its third is 429, with Retry-After
    slow = [SlowUpload(server.url + "v1/audio/transcriptions",
                       {**AUTH, "Content-Type": "multipart/form-data; boundary=x"})
            for _ in range(2)]
    with pytest.raises(openai.RateLimitError) as e:
        _transcribe(client, clip)
    assert e.value.code == "rate_limit_exceeded" and e.value.type == "requests"
    assert e.value.response.headers["Retry-After"] == "5"
    assert "has 2 uploads in progress already" in e.value.message
    for upload in slow:  # past --grace_seconds 3 at 2 bytes/s: 408, in OpenAI's shape too
        status, answer = upload.answer()
        assert status == 408 and answer["error"]["code"] == "slow_upload", answer
    assert _transcribe(client, clip).text  # their places are free again
    assert "Traceback" not in "".join(server.log)


@pytest.mark.slow
def test_curl_s_form_and_the_token_in_the_query(server, clip, offline):
    """What curl -F sends: the fields as form fields, the file a file part."""
    boundary = "b0undary"
    fields = {"model": NAME, "response_format": "verbose_json",
              "timestamp_granularities[]": "word"}
    body = b"".join(f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'
                    .encode() for k, v in fields.items())
    body += (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="c.wav"\r\n'
             "Content-Type: audio/wav\r\n\r\n").encode() + clip.read_bytes()
    body += f"\r\n--{boundary}--\r\n".encode()
    headers = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
    status, answer = http_json("POST", server.url + f"v1/audio/transcriptions?token={TOKEN}",
                               body, headers)
    assert status == 200, answer
    assert list(answer) == ["task", "language", "duration", "text", "words", "usage"]
    assert [(w["word"], w["start"], w["end"]) for w in answer["words"]] == [
        (w.text, w.start, w.end) for r in offline for w in r.words]
    status, _, data = http("GET", server.url + "v1/models", headers=AUTH)
    assert status == 200 and json.loads(data)["object"] == "list"


@pytest.mark.slow
def test_the_prompt_keywords_and_hotwords_bias_the_search_as_the_recognizer_does(
        client, checkpoint, tmp_path):
    rec = Recognizer.from_checkpoint(checkpoint)

    def offline(path, **hotwords):
        results = rec.transcribe_long(path, method="rescore", chunk_size=8, **hotwords)
        return " ".join(r.text for r in results if r.is_final and r.text)

    # a mix the model hears as "bad cafe", and as "bed cafe" with "bed" boosted
    for share in (0.7, 0.75, 0.8, 0.85, 0.9, 0.95):
        path = tmp_path / f"mixed_{share}.wav"
        sf.write(path, mixed_speech(share).numpy(), 16000, subtype="PCM_16")
        plain, boosted = offline(path), offline(path, hotwords=["bed"])
        if plain != boosted:
            break
    else:
        pytest.fail("no mix of the tones of 'a' and 'e' that a boost of 'bed' changes")
    assert boosted == "bed cafe" and plain != boosted
    assert offline(path, hotwords=["bed :0"]) == plain

    assert _transcribe(client, path).text == plain
    # hotwords as one field, or a list (which the client sends as hotwords[] fields)
    for kwargs in ({"prompt": "Bed, then cafe."}, {"keywords": ["bed"]},
                   {"extra_body": {"hotwords": "bed"}}, {"extra_body": {"hotwords": ["bed"]}}):
        assert _transcribe(client, path, **kwargs).text == boosted, kwargs
    assert _transcribe(client, path, extra_body={"hotwords": "bed :0, cafe :0"}).text == plain
    with pytest.raises(openai.BadRequestError) as e:
        _transcribe(client, path, extra_body={"hotwords": "bed :much"})
    assert e.value.param == "hotwords"
    assert e.value.body["message"] == "hotwords 'bed :much': boost 'much' is not a number"


@pytest.mark.slow
def test_a_search_without_hotwords_ignores_the_prompt_and_refuses_hotwords(checkpoint, clip):
    with served(checkpoint, "--chunk_size", "8", "--method", "greedy") as server:
        client = openai.OpenAI(base_url=server.url + "v1", api_key="any: no token asked",
                               max_retries=0, timeout=60)
        with open(clip, "rb") as f:
            raw = client.audio.transcriptions.with_raw_response.create(
                model="streaming.pt", file=f, prompt="bed", language="hi")
        assert raw.parse().text
        assert raw.headers["X-Konkanivani-Note"] == (
            "language 'hi' ignored: the model transcribes konkani; prompt ignored: this server "
            "decodes with greedy, which takes no hotwords (only beam, joint, rescore do: "
            "konkanivani-serve --method)")
        with pytest.raises(openai.BadRequestError) as e:
            _transcribe(client, clip, extra_body={"hotwords": "bed"})
        assert e.value.param == "hotwords" and "decodes with greedy" in e.value.message
        # the model's default name: its folder and file
        name = f"{checkpoint.parent.name}/{checkpoint.name}"
        assert [m.id for m in client.models.list()] == [name]
        assert client.models.retrieve(name).id == name  # a slash in it: the id is a path


@pytest.fixture(scope="module")
def full_checkpoint(tone_checkpoints):
    """A tiny full-context (not streaming) model of the tone sentences."""
    return tone_checkpoints["full"]


def _tool_rows(checkpoint, path, method, capsys):
    """What ``konkanivani-transcribe --format json`` prints for ``path``: its JSON rows."""
    from konkanivani.cli.transcribe import main

    capsys.readouterr()
    assert main([str(checkpoint), str(path), "--format", "json", "--method", method]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def _rows_of(results):
    """Results with text as the tool's rows have them: text and words (a whole file's row has no
    start and end; a segment's is its window's, compared apart)."""
    return [(r.text, [{"word": w.text, "start": w.start, "end": w.end,
                       "probability": w.probability} for w in r.words])
            for r in results if r.text]


@pytest.mark.slow
def test_a_full_context_checkpoint_s_words_are_those_konkanivani_transcribe_gives(
        full_checkpoint, clip, tmp_path, capsys):
    """Served with a full-context checkpoint, verbose_json's words (through OpenAI's client) are
    the tool's word for word: text, start, end and probability. The engine gives them for every
    method, of a file the tool decodes whole and of one over 30 s it decodes in windows."""
    from konkanivani.decoding.settings import DecodingConfig
    from konkanivani.serving.engine import Engine

    [row] = _tool_rows(full_checkpoint, clip, "rescore", capsys)
    assert row["text"] and row["words"] and all(w["probability"] > 0 for w in row["words"])
    with served(full_checkpoint, "--method", "rescore") as server:
        client = openai.OpenAI(base_url=server.url + "v1", api_key="none", max_retries=0,
                               timeout=60)
        answer = _transcribe(client, clip, response_format="verbose_json",
                             timestamp_granularities=["word", "segment"])
    assert answer.text == row["text"]
    assert [{"word": w.word, "start": w.start, "end": w.end,
             "probability": w.model_extra["probability"]} for w in answer.words] == row["words"]
    assert [(s.start, s.end) for s in answer.segments] == [(0.0, row["duration"])]

    # over the tool's 30 s, the clip again and again 3 s apart: in windows cut at its pauses
    piece = np.concatenate([load_audio(clip).numpy(), np.zeros(3 * 16000, np.float32)])
    long = tmp_path / "long.wav"
    sf.write(long, np.tile(piece, math.ceil(31 * 16000 / len(piece))), 16000, subtype="PCM_16")
    rec = Recognizer.from_checkpoint(full_checkpoint)
    for method in ("greedy", "beam", "attention", "joint", "rescore"):
        engine = Engine(rec, DecodingConfig(method=method))
        try:
            for path in (clip, long):
                rows = [r for r in _tool_rows(full_checkpoint, path, method, capsys) if r["text"]]
                results = engine.transcribe(load_audio(path))
                assert _rows_of(results) == [(r["text"], r["words"]) for r in rows], (method, path)
                if path == long:
                    assert len(rows) >= 2
                    assert [(r.start, r.end) for r in results if r.text] == [
                        (r["start"], r["end"]) for r in rows]
        finally:
            engine.close()


@pytest.mark.slow
def test_a_keyword_s_control_characters_are_escaped_in_the_log(server, clip):
    """A keywords[] field the model cannot spell is named in the log's warning: its control
    characters (an escape sequence that clears a terminal, a bell, a C1 CSI) written as escapes,
    none raw; the request itself is answered."""
    first = len(server.log)
    boundary = "b0undary"
    fields = [("model", NAME), ("keywords[]", "zq\x1b[2J\x07 \x9b1m")]
    body = b"".join(f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'
                    .encode() for k, v in fields)
    body += (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="c.wav"\r\n'
             "Content-Type: audio/wav\r\n\r\n").encode() + clip.read_bytes()
    body += f"\r\n--{boundary}--\r\n".encode()
    headers = {**AUTH, "Content-Type": f"multipart/form-data; boundary={boundary}"}
    status, answer = http_json("POST", server.url + "v1/audio/transcriptions", body, headers)
    assert status == 200 and answer["text"], answer
    assert wait_until(lambda: any("hotwords left out" in line for line in server.log[first:]), 30)
    logged = "".join(server.log[first:])
    assert "zq\\x1b 2j\\x07 \\x9b1m" in logged, logged
    assert not any(c in logged for c in "\x1b\x07\x9b")
