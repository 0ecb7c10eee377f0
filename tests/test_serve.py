"""konkanivani-serve as a client meets it: a server started on a free loopback port with a tiny
trained model, its upload and its WebSocket giving what the offline Recognizer gives on the same
audio, its token, its limits and its refusals; a fuzz of malformed uploads and frames after which it
still answers /health. Counted, never timed (every wait bounded)."""
import contextlib
import io
import json
import random
import re
import socket
import threading
import time
import wave

import numpy as np
import pytest
import soundfile as sf
import torch

# The server's extra (konkanivani[serve]) may be missing, as on a GPU machine set up for training:
# then these tests are skipped, saying so, instead of failing to collect.
for _module in ("starlette", "uvicorn", "websockets", "multipart", "prometheus_client"):
    pytest.importorskip(
        _module, reason="the serve extra is not installed: pip install 'konkanivani[serve]'"
    )

from serve_helpers import (  # noqa: E402
    SlowUpload,
    http,
    http_json,
    multipart,
    served,
    two_segment_clip,
    wait_until,
    ws_refusal,
    ws_session,
)
from websockets.exceptions import InvalidStatus  # noqa: E402

from konkanivani.cli import serve  # noqa: E402
from konkanivani.data.audio import load_audio  # noqa: E402
from konkanivani.decoding.model_export import Streaming, export_checkpoint  # noqa: E402
from konkanivani.decoding.recognizer import Recognizer  # noqa: E402
from konkanivani.serving.app import _Close, _samples  # noqa: E402
from konkanivani.serving.connections import LOG_EVERY_S  # noqa: E402
from konkanivani.serving.engine import check_sample_rate  # noqa: E402
from konkanivani.serving.limits import Limits  # noqa: E402

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CHUNK = ["--chunk_size", "8"]  # the tone models were trained for chunks of 1-8 frames
LIMITS = [
    "--max_upload_mb",
    "0.5",
    "--max_streams",
    "2",
    "--idle_seconds",
    "3",
    "--max_stream_seconds",
    "30",
    "--max_frame_kb",
    "64",
]
FRIEND = "http://friend.example:3000"  # a page origin the module's server allows (--allow_origin)
EVIL = "http://evil.example"
NAMED = "asr.example"  # a host name the module's server answers besides its own (--allow_host)
PROXY = "127.0.0.5"  # the one address whose X-Forwarded-For the module's server believes


# Without a server: frames, limits and flags.

def test_frames_become_samples_or_a_close_with_a_reason():
    pcm = np.array([0, 16384, -32768, 32767], "<i2").tobytes()
    assert np.allclose(_samples(pcm, np.dtype("<i2")), [0, 0.5, -1, 32767 / 32768])
    floats = np.array([0.25, -2.0, 3.0], "<f4").tobytes()
    assert np.allclose(_samples(floats, np.dtype("<f4")), [0.25, -1, 1])  # clipped
    for data, dtype, words in (
        (pcm[:3], "<i2", "whole 2-byte samples"),
        (floats[:5], "<f4", "whole 4-byte"),
        (np.array([np.nan], "<f4").tobytes(), "<f4", "NaN"),
    ):
        with pytest.raises(_Close, match=words) as e:
            _samples(data, np.dtype(dtype))
        assert e.value.code == 1007


def test_odd_sample_rates_are_refused_before_resampling_from_them():
    for rate in (8000, 11025, 16000, 22050, 44100, 48000, 96000, 192000):
        check_sample_rate(rate)
    for rate, words in (
        (7, "takes 8000 to 192000 Hz"),
        (2**31 - 1, "takes 8000"),
        (44101, "too odd a ratio"),
    ):
        with pytest.raises(ValueError, match=words):
            check_sample_rate(rate)


def test_limits_must_be_positive():
    assert Limits().max_upload_bytes == 25 * 2 ** 20
    with pytest.raises(ValueError, match="max_streams must be positive"):
        Limits(max_streams=0)
    with pytest.raises(ValueError, match=r"min_stream_rate must be at most 1 \(real time\)"):
        Limits(min_stream_rate=1.5)


@pytest.mark.parametrize("flags, message", [
    (["missing.pt"], "checkpoint missing.pt: file not found"),
    (["{ckpt}", "--max_streams", "0"], "--max_streams must be positive, got 0"),
    (["{ckpt}", "--chunk_size", "-1"],
     "--chunk_size must be 0 (none) or a positive number of encoder frames, got -1"),
    (["{ckpt}", "--decode_ctc_weight", "2"], "--decode_ctc_weight must be in [0, 1], got 2.0"),
    (["{ckpt}", "--allow_origin", "friend.example/app"],
     "--allow_origin 'friend.example/app': an origin is scheme://host[:port]"),
    (["{ckpt}", "--min_stream_rate", "2"],
     "--min_stream_rate must be at most 1 (real time), got 2.0"),
    (["{ckpt}", "--upload_timeout", "0"], "--upload_timeout must be positive, got 0.0"),
    (["{ckpt}", "--allow_origin", "http://*.example.com"],
     "--allow_origin 'http://*.example.com': an origin is scheme://host[:port]"),
    (["{ckpt}", "--allow_origin", "http://friend.example:99999"],
     "a port from 1 to 65535"),
    (["{ckpt}", "--allow_host", "asr.example:8000"], "--allow_host 'asr.example:8000': a host"),
    (["{ckpt}", "--allow_host", "*.example"], "--allow_host '*.example': a host"),
    (["{ckpt}", "--trust_proxy", "127.0.0.1,proxy.lan"],
     "--trust_proxy 'proxy.lan': an IP address or network"),
    (["{ckpt}", "--token", "s\u00e9cret"], "--token (or $KONKANIVANI_TOKEN) must be visible ASCII"),
    (["{ckpt}", "--token", "two words"], "must be visible ASCII characters (! to ~, no spaces)"),
])
def test_bad_flags_are_one_line_and_exit_2(tmp_path, capsys, flags, message):
    (tmp_path / "m.pt").write_bytes(b"")
    with pytest.raises(SystemExit) as e:
        serve.main([f.format(ckpt=tmp_path / "m.pt") for f in flags])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("host", ["", "  "])
def test_an_empty_host_is_one_line_and_exit_2_before_the_model_or_a_socket(
    tmp_path, monkeypatch, capsys, host
):
    """--host '' would listen on every interface under a warning that names none: refused in one
    line that says what to give, before the checkpoint is loaded or a socket made."""
    done = []
    monkeypatch.setattr(serve, "_serve", lambda *args: done.append("serve"))
    monkeypatch.setattr(serve, "_listen", lambda *args: done.append("listen"))
    monkeypatch.setattr(Recognizer, "from_checkpoint", lambda *args: done.append("load"))
    (tmp_path / "m.pt").write_bytes(b"")  # loaded, it would be refused in other words
    with pytest.raises(SystemExit) as e:
        serve.main([str(tmp_path / "m.pt"), "--host", host])
    captured = capsys.readouterr()
    assert e.value.code == 2 and not captured.out and not done
    assert captured.err.endswith(
        f"error: --host {host!r} is empty: give 0.0.0.0 (or ::) to listen on every interface, or "
        "leave it out for this machine alone (127.0.0.1) (see --help)\n")
    assert len(captured.err.splitlines()) == 1, captured.err


# Against a running server.

@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """Two tone sentences 1.2 s apart (two segments), as a 16-bit wav."""
    return two_segment_clip(tmp_path_factory.mktemp("serve_clip") / "two.wav")


@pytest.fixture(scope="module")
def server(tone_checkpoints):
    with served(tone_checkpoints["streaming"], "--token", TOKEN, *CHUNK, *LIMITS,
                "--allow_origin", FRIEND, "--allow_host", NAMED, "--trust_proxy", PROXY) as s:
        yield s


def _finals(results):
    return [{"text": r.text, "start": r.start, "end": r.end} for r in results if r.is_final]


def _pcm16_frames(path, samples=1600):
    with wave.open(str(path)) as w:
        data = w.readframes(w.getnframes())
    step = 2 * samples
    return [data[i:i + step] for i in range(0, len(data), step)]


@pytest.mark.slow
def test_upload_and_stream_give_what_the_recognizer_gives_offline(server, tone_checkpoints, clip):
    rec = Recognizer.from_checkpoint(tone_checkpoints["streaming"])
    offline = _finals(rec.transcribe_long(clip, method="rescore", chunk_size=8))
    assert len(offline) == 2 and all(r["text"] for r in offline)  # compared on two segments of text
    data = clip.read_bytes()
    for body, headers in ((data, {}), multipart("file", "../../etc/passwd", data)):
        status, result = http_json("POST", server.url + "transcribe", body, {**AUTH, **headers})
        assert status == 200, result
        assert [{k: s[k] for k in ("text", "start", "end")} for s in result["segments"]] == offline
        assert result["text"] == " ".join(r["text"] for r in offline)
        assert result["duration"] == pytest.approx(len(load_audio(clip)) / 16000, abs=1e-3)
        assert result["decode_seconds"] > 0 and result["streaming"] is True

    messages, closed = ws_session(server.ws_url + "stream", _pcm16_frames(clip), headers=AUTH)
    assert closed["code"] == 1000, closed
    assert messages[0]["type"] == "ready" and messages[0]["chunk_size"] == 8
    # the samples' format asked for, beside the model's own
    assert messages[0]["format"] == "pcm16" and messages[0]["model_format"] == "checkpoint"
    assert messages[-1]["type"] == "done"
    finals = [{k: m[k] for k in ("text", "start", "end")} for m in messages if m["type"] == "final"]
    assert finals == offline
    assert sum(m["type"] == "partial" for m in messages) >= 5
    assert all(
        set(w) == {"word", "start", "end"}
        for m in messages
        if m["type"] == "final"
        for w in m["words"]
    )

    # float32 at 48 kHz, resampled by the server's stream as the recognizer's own stream does
    wav48 = torch.from_numpy(
        np.interp(
            np.arange(3 * len(load_audio(clip))) / 3,
            np.arange(len(load_audio(clip))),
            load_audio(clip).numpy(),
        ).astype(np.float32)
    )
    offline48 = _finals(rec.stream_results(wav48.split(4800), chunk_size=8, sample_rate=48000))
    frames = [piece.numpy().astype("<f4").tobytes() for piece in wav48.split(4800)]
    messages, closed = ws_session(
        server.ws_url + "stream?format=float32&sample_rate=48000&token=" + TOKEN, frames
    )
    assert closed["code"] == 1000
    assert messages[0]["format"] == "float32" and messages[0]["model_format"] == "checkpoint"
    assert messages[0]["sample_rate"] == 48000
    assert [
        {k: m[k] for k in ("text", "start", "end")} for m in messages if m["type"] == "final"
    ] == offline48

    status, _, text = http("GET", server.url + "metrics", headers=AUTH)
    metrics = text.decode()
    assert status == 200
    assert 'konkanivani_requests_total{code="200",endpoint="/transcribe"} 2.0' in metrics
    assert 'konkanivani_requests_total{code="1000",endpoint="/stream"} 2.0' in metrics
    assert "konkanivani_active_streams 0.0" in metrics
    assert (
        "konkanivani_real_time_factor_count" in metrics
        and "konkanivani_audio_seconds_total" in metrics
    )
    # the decode threads' working seconds: some, and no more than the requests waited for them,
    # but for the end of a batched tick after it delivered a stream's results (a few ms each)
    busy = _metric(server, "_decode_thread_seconds_total")
    waited = sum(_metric(server, f'_decode_seconds_total{{endpoint="{e}"}}')
                 for e in ("/transcribe", "/stream"))
    assert 0 < busy <= 1.1 * waited


@pytest.mark.slow
def test_every_request_needs_the_token(server):
    for method, path in (("GET", ""), ("GET", "health"), ("GET", "metrics"), ("POST", "transcribe"),
                         ("GET", "static/app.js")):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            status, answer, _ = http(
                method, server.url + path, b"x" if method == "POST" else None, headers
            )
            assert status == 401, (path, status)
            assert answer.get("WWW-Authenticate") == "Bearer"
    assert ws_refusal(server.ws_url + "stream")[0] == 401
    assert ws_refusal(server.ws_url + "stream?token=wrong")[0] == 401
    assert http_json("GET", server.url + f"health?token={TOKEN}")[0] == 200
    status, headers, page = http("GET", server.url + f"?token={TOKEN}")
    assert status == 200 and b"<title>konkanivani</title>" in page
    assert "konkanivani_token=" in headers["Set-Cookie"] and "HttpOnly" in headers["Set-Cookie"]
    assert (
        http("GET", server.url + "health", headers={"Cookie": f"konkanivani_token={TOKEN}"})[0]
        == 200
    )


@pytest.mark.slow
def test_the_limits_answer_with_their_codes(server, clip):
    assert http("POST", server.url + "transcribe", bytes(600 * 1024), AUTH)[0] == 413
    for body, words in (
        (b"", "no audio"),
        (b"RIFF\x00\x00\x00\x00WAVEjunk" + bytes(100), "audio unreadable"),
        (clip.read_bytes()[:60], "audio"),
        (bytes(range(256)) * 4, "audio unreadable"),
    ):
        status, result = http_json("POST", server.url + "transcribe", body, AUTH)
        assert status == 400 and words in result["error"], result
        assert "/" not in result["error"].split(":")[0]  # named "the upload", never by a path

    for query, words in (
        ("sample_rate=44", "sample_rate must be"),
        ("format=mp3", "format must be one of"),
        ("sample_rate=44101", "too odd a ratio"),
        ("sample_rate=16000\u00b2", "sample_rate must be"),  # "²".isdigit(), which int refuses
        ("sample_rate=\u0967\u096c\u0966\u0966\u0966", "sample_rate must be"),  # Devanagari
        ("sample_rate=" + "1" * 5000, "sample_rate must be"),  # more digits than int reads
    ):
        status, _, answer = ws_refusal(server.ws_url + f"stream?{query}", AUTH)
        assert status == 400 and words in answer["error"]

    frames = _pcm16_frames(clip)
    for frame, code, words in (
        ("hello", 1003, "text frames take only"),
        (b"\x00" * 3, 1007, "whole 2-byte samples"),
        (bytes(65 * 1024), 1009, "at most 65536 a frame"),
    ):
        messages, closed = ws_session(
            server.ws_url + "stream", [frames[0], frame], "wait", headers=AUTH
        )
        assert closed["code"] == code and words in closed["reason"], closed
    # then idle
    messages, closed = ws_session(server.ws_url + "stream", frames[:12], "wait", headers=AUTH)
    assert closed["code"] == 1008 and "no audio for 3 s" in closed["reason"]
    # its last results before the close
    assert [m["type"] for m in messages][-2:] == ["final", "done"]

    # two streams open (the most), a third refused with a retry hint; /health answers meanwhile
    from websockets.sync.client import connect
    with connect(server.ws_url + "stream", additional_headers=AUTH, open_timeout=30) as a, \
            connect(server.ws_url + "stream", additional_headers=AUTH, open_timeout=30) as b:
        for ws in (a, b):
            assert json.loads(ws.recv(timeout=30))["type"] == "ready"
        status, headers, answer = ws_refusal(server.ws_url + "stream", AUTH)
        assert (
            status == 503
            and headers["Retry-After"] == "5"
            and "2 streams open already" in answer["error"]
        )
        for frame in frames:
            a.send(frame)
        status, health = http_json("GET", server.url + "health", headers=AUTH, timeout=10)
        assert status == 200 and health["active_streams"] == 2
    assert wait_until(
        lambda: http_json("GET", server.url + "health", headers=AUTH)[1]["active_streams"] == 0, 30
    )


@pytest.mark.slow
def test_the_longest_stream_and_upload(tone_checkpoints, clip):
    with served(
        tone_checkpoints["streaming"], *CHUNK, "--max_stream_seconds", "2",
        "--max_upload_seconds", "3"
    ) as server:
        status, result = http_json("POST", server.url + "transcribe", clip.read_bytes())
        assert status == 413 and "4.2 s of audio: the server takes at most 3 s" in result["error"]
        flac = io.BytesIO()  # a small file of much audio: refused by its header, before decoding it
        sf.write(flac, np.zeros(16000 * 3600, np.int16), 16000, format="FLAC")
        status, result = http_json("POST", server.url + "transcribe", flac.getvalue())
        assert status == 413 and "3600.0 s of audio" in result["error"]
        frames = _pcm16_frames(clip)  # 4.2 s
        messages, closed = ws_session(server.ws_url + "stream", frames, "wait")
        assert closed["code"] == 1008 and "reached 2 s" in closed["reason"]
        assert messages[-1] == {
            "type": "done",
            "audio_seconds": 2.0,
            "decode_seconds": messages[-1]["decode_seconds"],
        }


@pytest.mark.slow
def test_a_full_context_model_transcribes_in_windows_and_refuses_to_stream(tone_checkpoints, clip):
    rec = Recognizer.from_checkpoint(tone_checkpoints["full"])
    offline = _finals(rec.transcribe_long(clip, method="joint"))
    assert offline[0]["text"]
    with served(tone_checkpoints["full"]) as server:
        status, result = http_json("POST", server.url + "transcribe", clip.read_bytes())
        assert status == 200 and result["streaming"] is False and result["method"] == "joint"
        assert [{k: s[k] for k in ("text", "start", "end")} for s in result["segments"]] == offline
        status, _, answer = ws_refusal(server.ws_url + "stream")
        assert status == 409 and "cannot stream" in answer["error"]
        assert http_json("GET", server.url + "health")[1]["streaming"] is False


@pytest.mark.slow
def test_a_page_of_another_origin_is_refused_even_with_the_cookie(server):
    """A browser's request carries the page's Origin: another origin is 403 on every endpoint, the
    token's cookie notwithstanding (another port of the same host is another origin, though the
    same site); the server's own origin and --allow_origin's pass; requests without an Origin (curl,
    programs) are left to the token."""
    cookie = {"Cookie": f"konkanivani_token={TOKEN}"}
    own = server.url.rstrip("/")
    port = own.rsplit(":", 1)[1]
    refused = _metric(server, '_errors_total{endpoint="/stream",reason="origin"}')
    for origin in (EVIL, f"http://127.0.0.1:{int(port) + 1}", f"http://localhost:{port}",
                   f"https://127.0.0.1:{port}", "null"):
        for method, path in (("POST", "transcribe"), ("GET", "health"), ("GET", "")):
            body = b"x" if method == "POST" else None
            status, answer = http_json(method, server.url + path, body,
                                       {**cookie, **AUTH, "Origin": origin})
            assert status == 403 and "another origin" in answer["error"], (origin, path, status)
        status, _, answer = ws_refusal(server.ws_url + "stream", {**cookie, "Origin": origin})
        assert status == 403 and f"another origin ({origin})" in answer["error"]
    for origin in (None, own, own.upper(), FRIEND, FRIEND + "/"):
        headers = {**cookie, **({"Origin": origin} if origin else {})}
        status, answer = http_json("POST", server.url + "transcribe", b"x", headers)
        assert status == 400 and "audio unreadable" in answer["error"], (origin, answer)  # let in
        messages, closed = ws_session(server.ws_url + "stream", [], headers=headers)
        assert messages[0]["type"] == "ready" and closed["code"] == 1000, (origin, closed)
    # the Origin is checked before the token: a foreign page without it is refused the same
    assert http("GET", server.url + "health", headers={"Origin": EVIL})[0] == 403
    assert _metric(server, '_errors_total{endpoint="/stream",reason="origin"}') == refused + 5


@pytest.mark.slow
def test_a_foreign_host_is_400_before_any_endpoint(server):
    """DNS rebinding: a page of http://evil.example:PORT whose name resolves to 127.0.0.1 sends
    its requests with that Host (and its own origin, which the Origin check would take for the
    server's). Every endpoint and the WebSocket answer 400 for a Host of another name, with or
    without the token; the names this machine reaches the server by, and --allow_host's, pass."""
    port = server.url.rstrip("/").rsplit(":", 1)[1]
    answered = _metric(server, '_requests_total{code="200",endpoint="/health"}')
    for host in (f"evil.example:{port}", "evil.example", f"{NAMED}.evil.example:{port}",
                 f"127.0.0.1.evil.example:{port}"):
        for method, path in (("GET", ""), ("GET", "static/app.js"), ("GET", "health"),
                             ("GET", "metrics"), ("POST", "transcribe"), ("GET", "v1/models"),
                             ("POST", "v1/audio/transcriptions")):
            body = b"x" if method == "POST" else None
            for headers in ({}, AUTH, {**AUTH, "Origin": f"http://{host}"}):
                status, _, answer = http(method, server.url + path, body,
                                         {**headers, "Host": host})
                assert (status, answer) == (400, b"Invalid host header"), (host, path, status)
        assert _raw_handshake(server, host) == 400
    assert _metric(server, '_requests_total{code="200",endpoint="/health"}') == answered
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", f"LOCALHOST:{port}",
                 f"{NAMED}:{port}", NAMED):
        status, _, _ = http("GET", server.url + "health", None, {**AUTH, "Host": host})
        assert status == 200, host
        # the server's own origin is the name it was reached by
        status, _, _ = http("GET", server.url + "health", None,
                            {**AUTH, "Host": host, "Origin": f"http://{host}"})
        assert status == 200, host
        assert _raw_handshake(server, host) == 101
    assert "Traceback" not in "".join(server.log) and "ERROR" not in "".join(server.log)


def _raw_handshake(server, host: str) -> int:
    """The status that answers a WebSocket handshake to ``/stream`` sent with ``Host: host`` (the
    token in the query), read from the socket."""
    port = int(server.url.rstrip("/").rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), 30) as sock:
        sock.settimeout(30)
        sock.sendall(f"GET /stream?token={TOKEN} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket"
                     "\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                     "Sec-WebSocket-Version: 13\r\n\r\n".encode())
        head = b""
        while b"\r\n" not in head:
            chunk = sock.recv(4096)
            if not chunk:
                break
            head += chunk
    return int(head.split()[1])


@pytest.mark.slow
def test_x_forwarded_for_counts_only_from_a_trusted_proxy(server):
    """The per-client caps count the connection's address: a client that claims other addresses
    in X-Forwarded-For holds no more than --max_client_uploads (2) places; only --trust_proxy's
    address is believed, each client behind it counted apart."""
    def held(source, *claimed):
        return [SlowUpload(server.url + "transcribe", {**AUTH, "X-Forwarded-For": c},
                           source=source) for c in claimed]

    def third(source, claimed):
        return http("POST", server.url + "transcribe", b"x",
                    {**AUTH, "X-Forwarded-For": claimed}, source=source)

    uploads = held("127.0.0.2", "10.0.0.1", "10.0.0.2") + held(PROXY, "10.0.0.1", "10.0.0.1")
    status, _, answer = third("127.0.0.2", "10.0.0.3")
    assert status == 429 and "this client (127.0.0.2) has 2 uploads" in json.loads(answer)["error"]
    status, _, answer = third(PROXY, "10.0.0.3")  # another client behind the proxy: let in
    assert status == 400 and "audio unreadable" in json.loads(answer)["error"], answer
    status, _, answer = third(PROXY, "10.0.0.1")  # its client's third
    assert status == 429 and "this client (10.0.0.1)" in json.loads(answer)["error"], answer
    status, _, answer = third("127.0.0.3", "10.0.0.1")  # another client: served
    assert status == 400 and "audio unreadable" in json.loads(answer)["error"], answer
    for upload in uploads:  # 408 after the grace
        assert upload.answer()[0] == 408


def _lines(server, words: str) -> int:
    return sum(words in line for line in server.log)


@pytest.mark.slow
def test_slow_headers_and_sockets_beyond_the_cap_are_closed_and_logged_once(tone_checkpoints, clip):
    """Sockets that send nothing, or a header line now and then, are closed once --header_timeout
    passes without a whole request head; those beyond --max_connections are answered 503 at once.
    Each is one line in the log, however many sockets; then other clients are served."""
    with served(tone_checkpoints["streaming"], *CHUNK, "--header_timeout", "2",
                "--max_connections", "12") as server:
        port = int(server.url.rstrip("/").rsplit(":", 1)[1])
        started, first = time.monotonic(), len(server.log)
        held = [socket.create_connection(("127.0.0.1", port), 30) for _ in range(12)]
        for sock in held[:6]:
            sock.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n".encode())
        for _ in range(8):  # accepted after the twelve (the backlog's order): the thirteenth
            assert _refused(port)
        stop = threading.Event()

        def trickle():  # a header line every 0.5 s on the first six
            while not stop.wait(0.5):
                for sock in held[:6]:
                    with contextlib.suppress(OSError):
                        sock.sendall(b"X-Slow: yes\r\n")

        threading.Thread(target=trickle, daemon=True).start()
        try:
            assert all(_closed(sock) for sock in held)
        finally:
            stop.set()
            for sock in held:
                sock.close()
        status, result = http_json("POST", server.url + "transcribe", clip.read_bytes())
        assert status == 200 and result["text"], result
        messages, closed = ws_session(server.ws_url + "stream", _pcm16_frames(clip)[:5])
        assert messages[0]["type"] == "ready" and closed["code"] == 1000
        time.sleep(0.5)  # for the thread that reads the pipe
        once = 1 + int((time.monotonic() - started) // LOG_EVERY_S)
        assert 1 <= _lines(server, "connections refused (503): 12 open") <= once, server.log
        assert 1 <= _lines(server, "request head did not come within 2 s") <= once, server.log
        assert len(server.log[first:]) <= 2 * once, server.log
        assert "Traceback" not in "".join(server.log)


def _closed(sock: socket.socket) -> bool:
    """Whether the server closes ``sock`` without an answer (within 60 s): the end of its stream,
    or a reset where it closed with a header line unread."""
    sock.settimeout(60)
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True


def _refused(port: int) -> bool:
    """Whether a new connection is answered 503 before it sends anything."""
    with socket.create_connection(("127.0.0.1", port), 30) as sock:
        sock.settimeout(30)
        return sock.recv(4096).startswith(b"HTTP/1.1 503 ")


@pytest.mark.slow
def test_accepts_that_fail_for_want_of_files_are_logged_once(tone_checkpoints):
    """A process that may open few files (ulimit -n 150) with 300 sockets connecting: accept fails
    (EMFILE) again and again, logged once a minute, not once a try; the sockets wait in the
    backlog, are closed by --header_timeout as they come in, and then /health is answered."""
    with served(tone_checkpoints["streaming"], *CHUNK, "--header_timeout", "2",
                files=150) as server:
        assert "warning: this process may open 150 files (ulimit -n)" in "".join(server.log)
        port = int(server.url.rstrip("/").rsplit(":", 1)[1])
        started = time.monotonic()
        socks = [socket.create_connection(("127.0.0.1", port), 30) for _ in range(300)]
        try:
            assert wait_until(lambda: "Too many open files" in "".join(server.log), 30)
            # each closed by the deadline once accepted: the last of them within a bound
            assert all(_closed(sock) for sock in socks)
        finally:
            for sock in socks:
                sock.close()
        assert http_json("GET", server.url + "health", timeout=30)[0] == 200
        once = 1 + int((time.monotonic() - started) // LOG_EVERY_S)
        assert 1 <= _lines(server, "socket.accept() out of system resource") <= once, server.log
        assert _lines(server, "Too many open files") <= once
        assert _lines(server, "request head did not come within 2 s") <= once


def _metric(server, name: str) -> float:
    """A counter's value in the server's /metrics (``konkanivani`` + ``name``); 0 before one."""
    text = http("GET", server.url + "metrics", headers=AUTH)[2].decode()
    found = re.search(rf"^konkanivani{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def _close_reasons(results) -> list[tuple]:
    return [(closed["code"], closed["reason"].split(":")[0]) for _, closed in results]


@pytest.mark.slow
def test_slow_clients_hold_no_place(tone_checkpoints, clip):
    """Uploads whose bodies trickle are answered 408 once their rate or time runs out, and take no
    decode place meanwhile: a real upload is decoded beside two; streams that fall below half of
    real time are closed 1008 with the reason, and a real stream then has their place; one client
    address may hold 2 uploads and 2 streams (here), the next is 429. Small limits: seconds."""
    grace = 4  # s: every check of a slow client while it is still open comes within it
    flags = ["--grace_seconds", str(grace), "--min_upload_kb_s", "1", "--upload_timeout", "8",
             "--max_uploads", "2", "--max_client_uploads", "2", "--max_streams", "3",
             "--max_client_streams", "2", "--min_stream_rate", "0.5"]
    with served(tone_checkpoints["streaming"], *CHUNK, *flags) as server:
        # two uploads from one client send a byte every 0.5 s of the 100000 they announce
        slow = [SlowUpload(server.url + "transcribe", {}, source="127.0.0.2") for _ in range(2)]
        status, headers, answer = http("POST", server.url + "transcribe", b"x",  # its third: 429
                                       source="127.0.0.2")
        assert status == 429 and headers["Retry-After"] == "5", answer
        error = json.loads(answer)["error"]
        assert "this client (127.0.0.2) has 2 uploads in progress already" in error
        sent = time.monotonic()
        # another client's upload, while both still trickle
        status, result = http_json("POST", server.url + "transcribe", clip.read_bytes())
        assert status == 200 and result["text"], result
        for upload in slow:
            status, answer = upload.answer()
            assert status == 408 and "the upload came too slowly" in answer["error"], answer
            assert upload.answered > sent  # they were open while the real upload was decoded
            assert upload.answered - upload.started < 30
        # fast enough (2 KB every 0.5 s) but not done within --upload_timeout
        steady = SlowUpload(server.url + "transcribe", {}, piece=bytes(2048))
        status, answer = steady.answer()
        assert status == 408 and "within 8 s" in answer["error"], answer
        assert steady.answered - steady.started >= 8

        def trickle(source):  # a sample every 0.5 s, until the server closes
            return ws_session(server.ws_url + "stream", [b"\0\0"] * 120, "wait", pause=0.5,
                              source=source)

        def active():
            return http_json("GET", server.url + "health")[1]["active_streams"]

        results, threads = [], []
        for source in ("127.0.0.1", "127.0.0.1", "127.0.0.2"):
            threads.append(threading.Thread(target=lambda s=source: results.append(trickle(s))))
            threads[-1].start()
            assert wait_until(lambda: active() == len(threads), 30)
            if len(threads) == 2:  # the first client's third
                status, headers, answer = ws_refusal(server.ws_url + "stream", source="127.0.0.1")
                assert status == 429 and "(127.0.0.1) has 2 streams open already" in answer["error"]
        status, headers, answer = ws_refusal(server.ws_url + "stream", source="127.0.0.3")
        assert status == 503 and "3 streams open already" in answer["error"]  # all three held
        for thread in threads:
            thread.join(60)
        assert _close_reasons(results) == [(1008, "too slow")] * 3, results
        assert all("this server needs at least 0.5 of real time" in c["reason"] for _, c in results)
        assert all(m[0]["type"] == "ready" and m[-1]["type"] == "done" for m, _ in results)
        messages, closed = ws_session(server.ws_url + "stream", _pcm16_frames(clip))
        assert closed["code"] == 1000 and any(m["type"] == "final" and m["text"] for m in messages)
        metrics = http("GET", server.url + "metrics")[2].decode()
        assert 'konkanivani_errors_total{endpoint="/stream",reason="too_slow"} 3.0' in metrics
        assert '_errors_total{endpoint="/transcribe",reason="slow_upload"} 3.0' in metrics
        assert "Traceback" not in "".join(server.log)


@pytest.mark.slow
def test_refused_handshakes_and_clients_that_leave_log_no_errors(server):
    """A client that leaves mid-upload is one short line in the server's log, no traceback; a
    refused handshake (its HTTP answer sent) logs nothing (uvicorn's websockets-sansio protocol
    logged 'ASGI callable returned without completing handshake' for each)."""
    first = len(server.log)
    left = _metric(server, '_errors_total{endpoint="/transcribe",reason="disconnect"}')
    for query, headers, status in (("", {"Origin": EVIL}, 403), ("", {}, 401),
                                   ("?format=mp3", AUTH, 400)):
        assert ws_refusal(server.ws_url + "stream" + query, headers)[0] == status
    port = int(server.url.rstrip("/").rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), 30) as sock:
        sock.sendall(f"POST /transcribe HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: "
                     f"Bearer {TOKEN}\r\nContent-Length: 100000\r\n\r\n".encode() + bytes(1000))
    assert wait_until(lambda: "an upload ended early" in "".join(server.log[first:]), 30)
    # answered after the upload's handler ended: what the server wrote of it is in the pipe by now
    assert _metric(server, '_errors_total{endpoint="/transcribe",reason="disconnect"}') == left + 1
    time.sleep(0.5)  # for the thread that reads the pipe
    new = server.log[first:]
    assert len(new) == 1, new
    assert re.search(r"INFO an upload ended early: its client left after \d+ bytes$", new[0]), new


def _malformed_uploads(rng: random.Random, clip: bytes):
    """Seeded malformed uploads: random bytes, truncated and corrupted files, a header that lies,
    forms."""
    yield bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 3000))), {}
    cut = clip[:rng.randrange(1, len(clip))]
    yield cut, {}
    spoiled = bytearray(clip)
    for _ in range(rng.randrange(1, 20)):
        spoiled[rng.randrange(len(spoiled))] = rng.getrandbits(8)
    yield bytes(spoiled), {}
    header = bytearray(clip[:44])
    # sample rate
    header[24:28] = rng.choice([0, 1, 7, 2 ** 31 - 1, rng.getrandbits(32)]).to_bytes(4, "little")
    yield bytes(header) + clip[44:44 + rng.randrange(0, 4000)], {}
    body, headers = multipart(
        rng.choice(["file", "x", ""]),
        rng.choice(["a.wav", "/etc/passwd", "..\\x"]),
        bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 500))),
    )
    yield body[:rng.randrange(1, len(body) + 1)], headers
    garbage = bytes(rng.getrandbits(8) for _ in range(200))
    yield b"--b\r\n" + garbage, {"Content-Type": "multipart/form-data; boundary=b"}


def _malformed_frames(rng: random.Random):
    """Seeded malformed streams: random bytes and lengths, text, NaNs, oversize frames, a wrong
    rate."""
    kind = rng.randrange(5)
    if kind == 0:
        return "stream", [
            bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 4000))) for _ in range(3)
        ]
    if kind == 1:
        return "stream?format=float32", [
            np.array([rng.choice([np.nan, np.inf, 1e30, -1e30, 0.5])] * 64, "<f4").tobytes()
        ]
    if kind == 2:
        return "stream", [rng.choice(["", "{}", '{"type": "stop"}', "\u0915" * 300, "null"])]
    if kind == 3:
        return "stream", [bytes(rng.randrange(64 * 1024 + 1, 80 * 1024))]
    rate = rng.choice([8000, 11025, 22050, 44100, 96000, 44101, 7, 10 ** 9])
    return f"stream?sample_rate={rate}", [
        bytes(rng.getrandbits(8) for _ in range(2 * rng.randrange(1, 3000)))
    ]


@pytest.mark.slow
def test_fuzz_leaves_the_server_answering(server, clip):
    rng = random.Random(26)
    data, statuses, codes = clip.read_bytes(), [], []
    for _ in range(40):  # 6 uploads each: 240
        for body, headers in _malformed_uploads(rng, data):
            status, _, answer = http("POST", server.url + "transcribe", body, {**AUTH, **headers})
            statuses.append(status)
            assert status == 200 or 400 <= status < 500, (status, answer[:300])
    for _ in range(60):
        path, frames = _malformed_frames(rng)
        assert wait_until(
            lambda: http_json("GET", server.url + "health", headers=AUTH)[1]["active_streams"] == 0,
            30,
        )
        try:
            messages, closed = ws_session(
                server.ws_url + path, frames, rng.choice(["end", "hang_up"]), headers=AUTH
            )
        except InvalidStatus as e:  # a handshake refused: a rate the server does not take
            assert e.response.status_code == 400, e.response.body
            codes.append(400)
            continue
        codes.append(closed["code"])
        assert closed["code"] in (1000, 1003, 1007, 1009), closed
    assert {400, 413} <= set(statuses) or 400 in statuses
    assert {400, 1003, 1007, 1009} <= set(codes)
    assert server.alive() and "Traceback" not in "".join(server.log)
    status, health = http_json("GET", server.url + "health", headers=AUTH)
    assert status == 200 and health["status"] == "ok" and health["active_streams"] == 0


# An export folder (konkanivani-export) served on onnxruntime.


def test_a_folder_that_is_no_export_or_onnxruntime_missing_is_one_line_and_exit_2(
    tmp_path, monkeypatch, capsys
):
    assert serve.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not a konkanivani-export folder (no model.onnx, vocabulary.json, features.json)" in err
    assert len(err.strip().splitlines()) == 1
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "onnxruntime" else real_find_spec(name, *args),
    )
    assert serve.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "serving ONNX needs onnxruntime: pip install 'konkanivani[export]'" in err
    assert len(err.strip().splitlines()) == 1


EXPORT_STREAMING = Streaming(chunk_size=8, left_chunks=2)


@pytest.fixture(scope="module")
def exports(tone_checkpoints, tmp_path_factory):
    """The tone checkpoints through konkanivani-export: the streaming one with --streaming, chunks
    of 8
    seeing 2 back (encoder_chunk.onnx), the full-context one without (model.onnx alone)."""
    out = tmp_path_factory.mktemp("serve_exports")
    export_checkpoint(tone_checkpoints["streaming"], out / "streaming", ["onnx"], EXPORT_STREAMING)
    export_checkpoint(tone_checkpoints["full"], out / "full", ["onnx"])
    return {"streaming": out / "streaming", "full": out / "full"}


@pytest.mark.slow
def test_a_streaming_export_transcribes_and_streams_as_its_checkpoint_does(
    exports, tone_checkpoints, clip, capsys
):
    """Uploads through model.onnx in windows, with CTC prefix beam search, give the checkpoint's
    beam search in the same windows; /stream through encoder_chunk.onnx gives the checkpoint's
    stream in the
    same chunks (its partials too); settings an export cannot take are one line and exit 2."""
    rec = Recognizer.from_checkpoint(tone_checkpoints["streaming"])
    offline = _finals(rec.transcribe_long(clip, method="beam"))
    streamed = list(
        rec.stream_results(load_audio(clip).split(1600), chunk_size=8, left_chunks=2, method="beam")
    )
    assert len(_finals(streamed)) == 2 and all(r["text"] for r in offline + _finals(streamed))
    with served(exports["streaming"], "--token", TOKEN) as server:
        assert "(ONNX, streaming, beam)" in "".join(server.log)
        status, health = http_json("GET", server.url + "health", headers=AUTH)
        assert status == 200 and health["model_format"] == "onnx" and health["streaming"] is True
        assert (
            health["chunk_size"] == 8
            and health["left_chunks"] == 2
            and "no attention rescoring" in health["note"]
        )

        status, result = http_json("POST", server.url + "transcribe", clip.read_bytes(), AUTH)
        assert status == 200, result
        assert [{k: s[k] for k in ("text", "start", "end")} for s in result["segments"]] == offline
        assert result["method"] == "beam" and result["model_format"] == "onnx"

        messages, closed = ws_session(server.ws_url + "stream", _pcm16_frames(clip), headers=AUTH)
        assert closed["code"] == 1000, closed
        assert messages[0]["type"] == "ready" and messages[-1]["type"] == "done"
        assert messages[0]["format"] == "pcm16" and messages[0]["model_format"] == "onnx"
        results = [{k: m[k] for k in ("type", "text", "start", "end")} for m in messages[1:-1]]
        assert results == [
            {
                "type": "final" if r.is_final else "partial",
                "text": r.text,
                "start": r.start,
                "end": r.end,
            }
            for r in streamed
        ]
        assert sum(m["type"] == "partial" for m in results) >= 5
        assert server.alive() and "Traceback" not in "".join(server.log)

    capsys.readouterr()  # the offline stream's warning of chunks the model was not trained with
    for flags, words in (
        (["--method", "rescore"], "the attention decoder that rescore needs is not exported"),
        (["--chunk_size", "4"], "the export streams in chunks of 8 frames seeing 2 back"),
        (["--device", "cuda"], "served on onnxruntime's CPU provider"),
    ):
        assert serve.main([str(exports["streaming"]), *flags]) == 2
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_an_export_without_the_chunk_graph_transcribes_and_refuses_to_stream(
    exports, tone_checkpoints, clip
):
    rec = Recognizer.from_checkpoint(tone_checkpoints["full"])
    offline = _finals(rec.transcribe_long(clip, method="greedy"))
    words = [(w.text, w.start, w.end) for r in rec.transcribe_long(clip, method="greedy")
             for w in r.words]
    assert offline[0]["text"] and words
    with served(exports["full"], "--method", "greedy") as server:
        status, result = http_json("POST", server.url + "transcribe", clip.read_bytes())
        assert status == 200 and result["streaming"] is False and result["model_format"] == "onnx"
        assert [{k: s[k] for k in ("text", "start", "end")} for s in result["segments"]] == offline
        # the words aligned to model.onnx's CTC output: the checkpoint's times
        assert [(w["word"], w["start"], w["end"]) for s in result["segments"]
                for w in s["words"]] == words
        status, _, answer = ws_refusal(server.ws_url + "stream")
        assert (
            status == 409
            and "the export has no encoder_chunk.onnx: export with --streaming" in answer["error"]
        )
