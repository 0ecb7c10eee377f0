"""What the server's tests share: tiny models that learn four tone "sentences" in 120 steps
(tone_speech.py, as test_streaming_decode.py does), a server started as a person starts it
(``konkanivani-serve ... --port 0``,
on loopback) and plain clients for it. Every wait is bounded."""
from __future__ import annotations

import dataclasses
import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager
from email.message import Message
from http.client import HTTPConnection
from pathlib import Path

import torch
from tone_speech import SENTENCES, speech

from konkanivani.checkpoint import save_checkpoint
from konkanivani.config import model_config_from_preset
from konkanivani.data.tokenizer import train_tokenizer
from konkanivani.decoding.recognizer import Recognizer
from konkanivani.model.asr import ASRModel
from konkanivani.training.objective import Objective

START_SECONDS = 120  # a server that has not said where it listens by then has failed



def train_model(wavs: list[torch.Tensor], texts: list[str], streaming: bool, steps: int = 120,
                vocab_size: int = 16, frontend: str = "log_mel") -> Recognizer:
    """A tiny model that has learned ``texts`` (a char tokenizer of them) from ``wavs`` on the
    features of ``frontend``: with ``streaming``, for chunks of 1-8 frames and full context, with
    causal convolutions."""
    tokenizer = train_tokenizer(texts, vocab_size=vocab_size, model_type="char")
    torch.manual_seed(0)
    cfg = model_config_from_preset(
        "tiny",
        vocab_size=tokenizer.vocab_size,
        dropout=0.0,
        causal_conv=streaming,
        dynamic_chunk=streaming,
        max_chunk=8,
        frontend=frontend,
    )
    rec = Recognizer(ASRModel(cfg), tokenizer, torch.device("cpu"))
    model = rec.model
    feats = [rec.frontend(w) for w in wavs]
    every = torch.cat(feats)
    model.set_cmvn(every.mean(0), every.std(0))
    x, lens = torch.nn.utils.rnn.pad_sequence(feats, batch_first=True), torch.tensor(
        [len(f) for f in feats]
    )
    # "" (silence): none
    tokens = [torch.tensor(tokenizer.encode(s), dtype=torch.long) for s in texts]
    y = torch.nn.utils.rnn.pad_sequence(tokens, batch_first=True, padding_value=-1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        Objective()(model, x, lens, y, torch.tensor([len(t) for t in tokens])).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return Recognizer(model.eval(), tokenizer, torch.device("cpu"))


def two_segment_clip(path: Path) -> Path:
    """Two tone sentences 1.2 s apart (two segments), written to ``path`` as a 16-bit wav."""
    import soundfile as sf

    wav = torch.cat(
        [speech(SENTENCES[0], seed=7), torch.zeros(19200), speech(SENTENCES[1], seed=8)]
    )
    sf.write(path, wav.numpy(), 16000, subtype="PCM_16")
    return path


def tone_checkpoint(path: Path, streaming: bool, steps: int = 120,
                    frontend: str = "log_mel") -> Path:
    """A tone model trained ``steps`` (1 for a server whose words do not matter) saved to ``path``;
    the 120-step ones of log-mel features are conftest's ``tone_checkpoints``, trained once."""
    rec = train_model([speech(s, seed=i) for i, s in enumerate(SENTENCES)], SENTENCES, streaming,
                      steps, frontend=frontend)
    return save_recognizer(rec, path)


def save_recognizer(rec: Recognizer, path: Path) -> Path:
    """``rec``'s model and tokenizer saved to ``path`` as a checkpoint the tools load."""
    return save_checkpoint(
        {
            "model_config": dataclasses.asdict(rec.model.cfg),
            "model": rec.model.state_dict(),
            "tokenizer": rec.tokenizer.model_proto,
        },
        path,
    )


class Server:
    """A ``konkanivani-serve`` process; ``url`` is where it listens, ``log`` what it wrote to
    stderr. ``files``: the most files it may open (``ulimit -n``)."""

    def __init__(self, checkpoint: Path, *flags: str, files: int | None = None):
        def limit_files():
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "konkanivani.cli.serve", str(checkpoint), "--port", "0", *flags],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=limit_files if files else None,
        )
        self.log: list[str] = []
        self.ready = threading.Event()
        self.url = ""
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(START_SECONDS) or not self.url:
            self.stop()
            raise AssertionError("the server did not start:\n" + "".join(self.log)[-3000:])

    def _read(self) -> None:
        for line in self.proc.stderr:  # drained to the end: a full pipe would stall the server
            self.log.append(line)
            found = re.search(r" at (http://\S+/)", line)
            if found and not self.url:
                self.url = found.group(1)
                self.ready.set()
        self.ready.set()

    @property
    def ws_url(self) -> str:
        return "ws" + self.url[4:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(20)


@contextmanager
def served(checkpoint: Path, *flags: str, files: int | None = None):
    server = Server(checkpoint, *flags, files=files)
    try:
        yield server
    finally:
        server.stop()


def http(method: str, url: str, body: bytes | None = None, headers: dict | None = None,
         timeout: float = 60, source: str | None = None) -> tuple[int, Message, bytes]:
    """(status, headers (case-insensitive), body) of one request, an error status included;
    ``source``: from that loopback address (``connect_from``)."""
    if source is not None:
        parts = urllib.parse.urlsplit(url)
        connection = HTTPConnection(parts.hostname, parts.port, timeout=timeout,
                                    source_address=(source, 0))
        try:
            connection.request(method, parts.path, body, headers or {})
            response = connection.getresponse()
            return response.status, response.headers, response.read()
        finally:
            connection.close()
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def http_json(method: str, url: str, body: bytes | None = None, headers: dict | None = None,
              timeout: float = 60) -> tuple[int, dict]:
    status, _, data = http(method, url, body, headers, timeout)
    return status, json.loads(data)


def multipart(field: str, filename: str, data: bytes) -> tuple[bytes, dict]:
    """A multipart/form-data body with one file, and its Content-Type header."""
    boundary = "konkanivani-test-boundary"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="{field}";'
            f' filename="{filename}"\r\nContent-Type: application/octet-stream\r\n\r\n'
        ).encode()
        + data
        + f"\r\n--{boundary}--\r\n".encode()
    )
    return body, {"Content-Type": f"multipart/form-data; boundary={boundary}"}


def wait_until(condition, seconds: float, every: float = 0.1) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(every)
    return condition()


def connect_from(url: str, source: str | None, timeout: float = 30) -> socket.socket | None:
    """A TCP connection to ``url``'s host and port from the loopback address ``source`` (the server
    sees another client: any 127.x.y.z is this machine on Linux); None for the default address."""
    if source is None:
        return None
    parts = urllib.parse.urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout,
                                    source_address=(source, 0))


def ws_session(url: str, frames, then: str = "end", headers: dict | None = None, pause: float = 0.0,
               timeout: float = 60, source: str | None = None) -> tuple[list[dict], dict]:
    """Send ``frames`` (bytes: binary, str: text) over a WebSocket, then (``then``) ``{"type":
    "end"}``, or hang up, or wait for the server to close; the JSON messages received (read by a
    thread as they
    come) and ``{"code", "reason"}`` of the close frame received. ``source``: ``connect_from``'s."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    messages, closed = [], {}
    with connect(url, additional_headers=headers, open_timeout=timeout, close_timeout=timeout,
                 max_size=None, sock=connect_from(url, source)) as ws:
        def read():
            try:
                while True:
                    messages.append(json.loads(ws.recv(timeout=timeout)))
            except ConnectionClosed as e:
                closed.update(
                    code=e.rcvd.code if e.rcvd else None, reason=e.rcvd.reason if e.rcvd else ""
                )
            except TimeoutError:
                closed.update(code="timeout", reason="")

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            for frame in frames:
                ws.send(frame)
                if pause:
                    time.sleep(pause)
            if then == "end":
                ws.send(json.dumps({"type": "end"}))
            elif then == "hang_up":
                ws.close()
        except ConnectionClosed:
            pass  # the server closed first: its reason is read below
        reader.join(timeout + 5)
    return messages, closed


def ws_refusal(url: str, headers: dict | None = None, timeout: float = 30,
               source: str | None = None):
    """The HTTP answer (status, headers, body) that refused a WebSocket handshake; None if it
    opened."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    try:
        with connect(url, additional_headers=headers, open_timeout=timeout, close_timeout=timeout,
                     sock=connect_from(url, source)):
            return None
    except InvalidStatus as e:
        return e.response.status_code, e.response.headers, json.loads(e.response.body or b"{}")


class SlowUpload:
    """A POST of ``length`` bytes that sends ``piece`` every ``every`` seconds from ``source`` (a
    thread), until the server answers or closes or ``seconds`` pass; its answer is read by another
    thread as it comes: ``answer()`` is (status, JSON body), ``answered`` the monotonic time its
    first bytes came."""

    def __init__(self, url: str, headers: dict, length: int = 100_000, piece: bytes = b"\0",
                 every: float = 0.5, source: str = "127.0.0.1", seconds: float = 60):
        parts = urllib.parse.urlsplit(url)
        self.sock = connect_from(url, source, timeout=seconds)
        head = [f"POST {parts.path} HTTP/1.1", f"Host: {parts.netloc}", f"Content-Length: {length}",
                *(f"{k}: {v}" for k, v in headers.items())]
        self.sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        self.started, self.answered, self.seconds, self.data = time.monotonic(), None, seconds, b""
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._send, args=(piece, every, length)),
                        threading.Thread(target=self._read)]
        for thread in self.threads:
            thread.daemon = True
            thread.start()

    def _send(self, piece: bytes, every: float, length: int) -> None:
        sent = 0
        while sent < length and not self.stop.wait(every):
            try:
                self.sock.sendall(piece)
            except OSError:  # the server closed: its answer is read by _read
                return
            sent += len(piece)

    def _read(self) -> None:
        try:
            while b"\r\n\r\n" not in self.data or len(self.data) < self._length(self.data):
                chunk = self.sock.recv(65536)
                if not chunk:
                    break
                self.answered = self.answered or time.monotonic()
                self.data += chunk
        except OSError:
            pass  # a timeout or a reset: answer() says what came
        finally:
            self.stop.set()

    def answer(self) -> tuple[int, dict]:
        for thread in self.threads:
            thread.join(self.seconds + 5)
        self.sock.close()
        head, _, body = self.data.partition(b"\r\n\r\n")
        assert head, "no answer"
        return int(head.split()[1]), json.loads(body)

    @staticmethod
    def _length(data: bytes) -> int:
        """The whole answer's bytes, by its Content-Length, once its head is in."""
        head = data.partition(b"\r\n\r\n")[0]
        found = re.search(rb"(?im)^content-length:\s*(\d+)", head)
        return len(head) + 4 + int(found.group(1)) if found else len(data) + 1
