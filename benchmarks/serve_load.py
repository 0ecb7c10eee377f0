#!/usr/bin/env python3
"""konkanivani-serve under load, on loopback: 1, 4 and 16 concurrent streams of real-time audio.

A server is started on a free loopback port with the checkpoint (or, without one, an untrained
``small`` streaming model: the compute of the real thing, not its words). For each count of streams,
that many WebSocket clients each send ``--seconds`` of speech (the demo corpus's test clips, else
tones) as 100 ms 16-bit PCM frames, paced in real time, starts spread over one chunk; then
``{"type": "end"}``. Reported per count:

- partial latency p50/p95/max: from sending the frame that completed a chunk to receiving the result
  it brought (each result says how much audio the stream had taken when it was made:
  ``audio_seconds``);
- the real-time factor: the server's decode seconds over audio seconds (from its ``done`` messages,
  waiting for the decode thread included, and for a batched stream its tick until its own results),
  and its ``/metrics`` totals;
- the decode-thread real-time factor: the seconds the decode thread spent working over the audio
  seconds, every stream's together (``/metrics``' ``konkanivani_decode_thread_seconds_total``): what
  the load costs the CPU, the figure batching lowers;
- the end lag: from sending the end to receiving ``done``;
- errors: streams that did not end with ``done`` and close 1000, refused handshakes, lost finals.

``--field_mb 24`` adds a row a server: ``/health`` latency p50/p99/max while forms of that many MB
of comma-separated hotwords (fields of 500 KB, each under the server's field bound) arrive one after
another for ``--field_seconds``, and the status they were answered with (400: refused before a
hotword is split); ``--slow_sockets 1000`` holds that many connections sending their headers a line
every 2 s meanwhile.

``--modes batched,per_stream`` runs the same load twice, side by side: a server that encodes the
chunks of concurrent streams in one batched forward (the default) and one started with
``--no_batch_streams`` (one forward a chunk). ``--upload_seconds S`` runs each load twice more
alike: alone, then while one upload of ``S`` seconds (``POST /transcribe``) decodes on the server's
upload lane, its row giving the streams' partial p95 over their p95 alone and whether the upload was
still decoding when the streams ended (else the row measured less than it says). ``--csv`` writes
the rows.

    python benchmarks/serve_load.py --streams 4 --seconds 20 --upload_seconds 600

    python benchmarks/serve_load.py --checkpoint checkpoints/streaming/best.pt --streams 1,4,16,64
    --seconds 20 --modes batched,per_stream --csv benchmarks/results/serve_load/serve_load.csv

Bounded: ``--seconds`` of audio a stream, and ``--timeout`` for any stream to finish.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import numpy as np
import torch

from konkanivani.checkpoint import InferenceModel
from konkanivani.config import model_config_from_preset
from konkanivani.data.audio import load_audio
from konkanivani.data.frames import SAMPLE_RATE
from konkanivani.data.manifest import read_manifest, resolve_audio_path
from konkanivani.data.tokenizer import train_tokenizer
from konkanivani.decoding.settings import CHUNK_SIZE
from konkanivani.model.asr import ASRModel
from konkanivani.training.curves import text_table
from konkanivani.training.precision import cpu_description

FRAME = SAMPLE_RATE // 10  # 100 ms
# the server each --modes name starts: its flags
MODES = {"batched": [], "per_stream": ["--no_batch_streams"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--checkpoint", type=Path, help="a streaming checkpoint (default: an untrained small one)"
    )
    parser.add_argument(
        "--preset", default="small", help="the untrained model's preset (default: %(default)s)"
    )
    parser.add_argument("--corpus", type=Path, default=ROOT / "data" / "demo")
    parser.add_argument("--streams", default="1,4,16")
    parser.add_argument(
        "--seconds", type=float, default=20.0, help="audio per stream (default: %(default)s)"
    )
    parser.add_argument("--chunk_size", type=int, default=CHUNK_SIZE)
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="the most any stream may take past its audio"
    )
    parser.add_argument(
        "--server_flags", default="", help="more flags for konkanivani-serve, in one string"
    )
    parser.add_argument(
        "--modes", default="batched",
        help="batched (the default server), per_stream (--no_batch_streams), or both,"
        " comma-separated: the same load on each, side by side (default: %(default)s)",
    )
    parser.add_argument(
        "--upload_seconds", type=float, default=0.0,
        help="also run each load while an upload of this many seconds decodes (default: off)",
    )
    parser.add_argument("--csv", type=Path, help="write the rows here too")
    parser.add_argument("--field_mb", type=float, default=0.0,
                        help="/health while forms of this many MB of hotwords arrive (0: not run)")
    parser.add_argument("--field_seconds", type=float, default=10.0)
    parser.add_argument("--slow_sockets", type=int, default=0,
                        help="with --field_mb: also hold this many connections that send their "
                             "headers a line every 2 s (reopened when the server closes them)")
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.streams.split(",")]
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES):
        parser.error(f"--modes takes {', '.join(MODES)}, got {args.modes}")
    audio = _audio(args.corpus, args.seconds)
    upload = _wav_bytes(_audio(args.corpus, args.upload_seconds)) if args.upload_seconds else None
    upload_flags = ["--max_upload_seconds", str(args.upload_seconds + 1), "--max_upload_mb",
                    str(len(upload or b"") / 2 ** 20 + 1)] if upload else []
    rows, metrics, fields = [], {}, []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint or _untrained(Path(tmp) / "untrained.pt", args.preset, audio)
        for mode in modes:
            server = _start(
                checkpoint,
                [
                    "--chunk_size",
                    str(args.chunk_size),
                    # every stream comes from this one client address
                    "--max_streams",
                    str(max(counts)),
                    "--max_client_streams",
                    str(max(counts)),
                    *MODES[mode],
                    *upload_flags,
                    *args.server_flags.split(),
                ],
            )
            try:
                for n in counts:
                    alone = None
                    for body in (None, upload) if upload else (None,):
                        with _uploading(server["http"], body, args.timeout) as upload_state:
                            before = _counters(server["http"])
                            row = _load(server["ws"], audio, n, args.chunk_size, args.timeout)
                            busy, audio_s = (a - b for a, b in
                                             zip(_counters(server["http"]), before))
                        # an upload that ended before the streams did: not beside all of them
                        row["upload"] = "-" if body is None else (
                            f"{args.upload_seconds:g} s"
                            + ("" if upload_state["busy"] else " (ended first)"))
                        row["cpu_rtf"] = round(busy / audio_s, 4) if audio_s else "-"
                        if body is None:
                            alone, row["p95_vs_alone"] = row, "-"
                        elif isinstance(row["p95_ms"], int) and alone["p95_ms"] not in ("-", 0):
                            row["p95_vs_alone"] = round(row["p95_ms"] / alone["p95_ms"], 2)
                        else:
                            row["p95_vs_alone"] = "-"
                        rows.append({"mode": mode, **row})
                metrics[mode] = _metrics(server["http"])
                if args.field_mb:
                    fields.append({"mode": mode, **_field_load(server["http"], args.field_mb,
                                                               args.field_seconds,
                                                               args.slow_sockets)})
            finally:
                server["proc"].terminate()
                server["proc"].wait(30)
    print(
        f"\nCPU: {cpu_description()}, {os.cpu_count()} cores; torch {torch.__version__}; model:"
        f" {args.checkpoint or f'untrained {args.preset} (--causal_conv --dynamic_chunk)'}; chunks"
        f" of {args.chunk_size} frames ({args.chunk_size * 40} ms); {args.seconds:g} s of audio a"
        " stream, in real time"
    )
    titles = {
        "mode": "server",
        "streams": "streams",
        "upload": "upload beside",
        "partials": "partials",
        "p50_ms": "partial latency p50 ms",
        "p95_ms": "p95 ms",
        "max_ms": "max ms",
        "p95_vs_alone": "p95 / alone",
        "rtf": "real-time factor",
        "cpu_rtf": "decode-thread RTF",
        "end_lag_ms": "end to done ms (max)",
        "errors": "errors",
    }
    print(text_table(rows, list(titles), list(titles.values())))
    for mode, line in metrics.items():
        print(f"server /metrics ({mode}): {line}")
    if fields:
        print(f"\n/health while forms of {args.field_mb:g} MB of hotwords arrive"
              + (f" and {args.slow_sockets} connections send their headers slowly:"
                 if args.slow_sockets else ":"))
        names = ["mode", "forms", "status", "slow", "health", "p50_ms", "p99_ms", "max_ms"]
        print(text_table(fields, names, ["server", "forms sent", "answered",
                                         "slow connections opened", "/health asked", "p50 ms",
                                         "p99 ms", "max ms"]))
    if args.csv:
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        with args.csv.open("w", newline="") as f:
            writer = csv.DictWriter(f, list(titles))
            writer.writeheader()
            writer.writerows(rows)
    return 0


def _audio(corpus: Path, seconds: float) -> np.ndarray:
    """``seconds`` of 16-bit speech: the corpus's test clips with 0.5 s between, else tones."""
    manifest, target = corpus / "test.jsonl", round(seconds * SAMPLE_RATE)
    pieces, total = [], 0
    if manifest.is_file():
        for _, row in read_manifest(manifest):
            wav = load_audio(resolve_audio_path(row["audio_filepath"], manifest.parent)).numpy()
            pieces += [wav, np.zeros(SAMPLE_RATE // 2, np.float32)]
            total += len(wav) + SAMPLE_RATE // 2
            if total >= target:
                break
    if total < target:
        t = np.arange(target - total) / SAMPLE_RATE
        pieces.append(
            (0.3 * np.sin(2 * math.pi * 440 * t) * (np.sin(2 * math.pi * 0.5 * t) > 0)).astype(
                np.float32
            )
        )
    wav = np.concatenate(pieces)[:target]
    return (np.clip(wav, -1, 1) * 32767).astype("<i2")


def _wav_bytes(audio: np.ndarray) -> bytes:
    import io

    import soundfile as sf

    buffer = io.BytesIO()
    sf.write(buffer, audio, SAMPLE_RATE, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


@contextlib.contextmanager
def _uploading(http_url: str, body: bytes | None, timeout: float):
    """While the block runs, one upload of ``body`` decoding (none for None), posted a second
    before it so that its bytes are in and its decoding begun; the dict given says whether it was
    still going when the block ended (``busy``) and how it ended."""
    import urllib.request

    state: dict = {}
    if body is None:
        yield state
        return

    def post():
        request = urllib.request.Request(http_url + "transcribe", data=body,
                                         headers={"Content-Type": "audio/wav"})
        try:
            with urllib.request.urlopen(request, timeout=len(body) / 32000 + timeout) as answer:
                state["status"] = answer.status
        except Exception as e:  # noqa: BLE001  reported with the row
            state["status"] = f"{type(e).__name__}: {e}"
        state["ended"] = time.perf_counter()

    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    time.sleep(1.0)
    try:
        yield state
    finally:
        state["busy"] = "ended" not in state
        thread.join(len(body) / 32000 + timeout)
        print(f"upload: {state.get('status')}", file=sys.stderr, flush=True)


def _untrained(path: Path, preset: str, audio: np.ndarray) -> Path:
    """An untrained streaming model of ``preset`` with CMVN from ``audio``, and a small char
    tokenizer."""
    from konkanivani.data.features import LogMel

    tokenizer = train_tokenizer(
        ["कोंकणी भास", "हांव पणजेक वता", "abc def ghi jkl"], vocab_size=64, model_type="char"
    )
    torch.manual_seed(0)
    cfg = model_config_from_preset(
        preset, vocab_size=tokenizer.vocab_size, causal_conv=True, dynamic_chunk=True
    )
    model = ASRModel(cfg).eval()
    feats = LogMel(cfg.n_mels)(torch.from_numpy(audio.astype(np.float32) / 32768))
    model.set_cmvn(feats.mean(0), feats.std(0))
    return InferenceModel(dataclasses.asdict(cfg), model.state_dict(), tokenizer.model_proto,
                          ema=False).save(path)


def _start(checkpoint: Path, flags: list[str]) -> dict:
    proc = subprocess.Popen(
        [sys.executable, "-m", "konkanivani.cli.serve", str(checkpoint), "--port", "0", *flags],
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        print(line, end="", file=sys.stderr)
        found = re.search(r" at (http://\S+/)", line)
        if found:
            # keep it drained
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return {"proc": proc, "http": found.group(1), "ws": "ws" + found.group(1)[4:]}
    proc.kill()
    raise SystemExit("the server did not start")


def _load(ws_url: str, audio: np.ndarray, streams: int, chunk: int, timeout: float) -> dict:
    frames = [audio[i:i + FRAME].tobytes() for i in range(0, len(audio), FRAME)]
    outcomes: list[dict] = [{} for _ in range(streams)]
    threads = [
        threading.Thread(
            target=_client,
            args=(ws_url + "stream", frames, i * chunk * 0.04 / streams, timeout, outcomes[i]),
        )
        for i in range(streams)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(len(frames) * 0.1 + timeout + 30)
    latencies = [x for o in outcomes for x in o.get("latencies", [])]
    done = [o for o in outcomes if o.get("done") and o.get("code") == 1000]
    lost = sum(1 for o in done if not o.get("finals"))
    audio_s = sum(o["done"]["audio_seconds"] for o in done)
    row = {
        "streams": streams,
        "partials": len(latencies),
        "p50_ms": round(1000 * statistics.median(latencies)) if latencies else "-",
        "p95_ms": round(1000 * _quantile(latencies, 0.95)) if latencies else "-",
        "max_ms": round(1000 * max(latencies)) if latencies else "-",
        "rtf": (
            round(sum(o["done"]["decode_seconds"] for o in done) / audio_s, 3) if audio_s else "-"
        ),
        "end_lag_ms": round(1000 * max(o["end_lag"] for o in done)) if done else "-",
        "errors": streams - len(done) + lost,
    }
    print(row, [o.get("error") for o in outcomes if o.get("error")], file=sys.stderr, flush=True)
    return row


def _client(url: str, frames: list[bytes], delay: float, timeout: float, out: dict) -> None:
    """One real-time stream: frame i sent at start + 0.1 i s; what it measured in ``out``."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    time.sleep(delay)
    sent_at: list[float] = []  # when the frame that brought the stream to (i + 1) * 0.1 s was sent
    out.update(latencies=[], finals=0)
    try:
        with connect(url, open_timeout=60, close_timeout=30, max_size=None) as ws:
            json.loads(ws.recv(timeout=60))  # ready

            def read():
                try:
                    while True:
                        msg = json.loads(ws.recv(timeout=len(frames) * 0.1 + timeout))
                        now = time.perf_counter()
                        if msg["type"] == "partial":
                            frame = max(0, math.ceil(msg["audio_seconds"] / 0.1 - 1e-6) - 1)
                            out["latencies"].append(now - sent_at[frame])
                        out["finals"] += msg["type"] == "final"
                        if msg["type"] == "done":
                            out["done"], out["end_lag"] = msg, now - out["end_sent"]
                except ConnectionClosed as e:
                    out["code"] = e.rcvd.code if e.rcvd else None
                except TimeoutError:
                    out["error"] = "timeout"

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            start = time.perf_counter()
            for i, frame in enumerate(frames):
                pause = start + 0.1 * i - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
                sent_at.append(time.perf_counter())
                ws.send(frame)
            out["end_sent"] = time.perf_counter()
            ws.send(json.dumps({"type": "end"}))
            reader.join(timeout + 10)
    # a refused handshake, a reset: counted as this stream's error
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"


def _field_load(http_url: str, mb: float, seconds: float, slow_sockets: int = 0) -> dict:
    """``/health``'s latency while forms of ``mb`` MB of hotwords (and no audio) are posted one
    after another for ``seconds``, and ``slow_sockets`` connections send a request's headers a line
    every 2 s: the forms sent, the statuses they got, the slow connections opened, p50/p99/max."""
    import urllib.error
    import urllib.request

    field = b"bed," * 125_000  # 500 KB
    body = b"".join(b'--b\r\nContent-Disposition: form-data; name="hotwords[]"\r\n\r\n'
                    + field + b"\r\n" for _ in range(max(1, round(mb * 2 ** 20 / len(field)))))
    body += b"--b--\r\n"
    statuses, done = [], threading.Event()

    def send():
        while not done.is_set():
            request = urllib.request.Request(
                http_url + "v1/audio/transcriptions", body, method="POST",
                headers={"Content-Type": "multipart/form-data; boundary=b"})
            try:
                statuses.append(urllib.request.urlopen(request, timeout=120).status)
            except urllib.error.HTTPError as e:
                statuses.append(e.code)

    opened = [0]

    def slow():
        """``slow_sockets`` connections, each sending a header line every 2 s, reopened when the
        server closes one (its deadline for headers)."""
        import resource
        import socket
        import urllib.parse

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, slow_sockets + 256)),
                                                    hard))
        address = urllib.parse.urlsplit(http_url)
        conns: list = [None] * slow_sockets
        while not done.is_set():
            for i in range(slow_sockets):
                try:
                    if conns[i] is None:
                        conns[i] = socket.create_connection((address.hostname, address.port), 5)
                        conns[i].sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                        opened[0] += 1
                    else:
                        conns[i].sendall(b"X-Slow: 1\r\n")
                except OSError:  # closed by the server, or refused over its cap: open again
                    if conns[i] is not None:
                        conns[i].close()
                    conns[i] = None
            done.wait(2.0)
        for conn in conns:
            if conn is not None:
                conn.close()

    threads = [threading.Thread(target=send, daemon=True)]
    if slow_sockets:
        threads.append(threading.Thread(target=slow, daemon=True))
    for thread in threads:
        thread.start()
    times, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.monotonic()
        urllib.request.urlopen(http_url + "health", timeout=120).read()
        times.append((time.monotonic() - start) * 1000)
        time.sleep(0.01)
    done.set()
    for thread in threads:
        thread.join(150)
    return {"forms": len(statuses), "status": ",".join(map(str, sorted(set(statuses)))),
            "slow": opened[0], "health": len(times), "p50_ms": round(_quantile(times, 0.5), 1),
            "p99_ms": round(_quantile(times, 0.99), 1), "max_ms": round(max(times), 1)}


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _metrics_text(http_url: str) -> str:
    import urllib.request

    return urllib.request.urlopen(http_url + "metrics", timeout=30).read().decode()


def _counters(http_url: str) -> tuple[float, float]:
    """The server's decode-thread seconds and streamed audio seconds so far (``/metrics``)."""
    values = {}
    for line in _metrics_text(http_url).splitlines():
        if line.startswith(("konkanivani_decode_thread_seconds_total ",
                            'konkanivani_audio_seconds_total{endpoint="/stream"}')):
            values[line.split()[0]] = float(line.split()[-1])
    return (values.get("konkanivani_decode_thread_seconds_total", 0.0),
            values.get('konkanivani_audio_seconds_total{endpoint="/stream"}', 0.0))


def _metrics(http_url: str) -> str:
    text = _metrics_text(http_url)
    wanted = (
        "konkanivani_audio_seconds_total",
        "konkanivani_decode_seconds_total",
        "konkanivani_errors_total",
    )
    return "; ".join(
        line for line in text.splitlines()
        if line.startswith(wanted) and "/stream" in line
        or line.startswith("konkanivani_decode_thread_seconds_total ")
    )


if __name__ == "__main__":
    sys.exit(main())
