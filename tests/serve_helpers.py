"""What the server's tests share: tiny models that learn four tone "sentences" in 120 steps (tone_speech.py,
as test_streaming_decode.py does), a server started as a person starts it (``konkanivani-serve ... --port 0``,
on loopback) and plain clients for it. Every wait is bounded."""
from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from email.message import Message
from pathlib import Path

import torch
from tone_speech import SENTENCES, speech

from konkanivani.checkpoint import save_checkpoint
from konkanivani.config import model_config_from_preset
from konkanivani.data.tokenizer import train_tokenizer
from konkanivani.decoding.recognizer import Recognizer
from konkanivani.model.asr import ASRModel

START_SECONDS = 120  # a server that has not said where it listens by then has failed



def train_model(wavs: list[torch.Tensor], texts: list[str], streaming: bool, steps: int = 120,
                vocab_size: int = 16) -> Recognizer:
    """A tiny model that has learned ``texts`` (a char tokenizer of them) from ``wavs``: with
    ``streaming``, for chunks of 1-8 frames and full context, with causal convolutions."""
    tokenizer = train_tokenizer(texts, vocab_size=vocab_size, model_type="char")
    torch.manual_seed(0)
    cfg = model_config_from_preset("tiny", vocab_size=tokenizer.vocab_size, dropout=0.0, causal_conv=streaming,
                                   dynamic_chunk=streaming, max_chunk=8)
    rec = Recognizer(ASRModel(cfg), tokenizer, torch.device("cpu"))
    model = rec.model
    feats = [rec.log_mel(w) for w in wavs]
    every = torch.cat(feats)
    model.set_cmvn(every.mean(0), every.std(0))
    x, lens = torch.nn.utils.rnn.pad_sequence(feats, batch_first=True), torch.tensor([len(f) for f in feats])
    tokens = [torch.tensor(tokenizer.encode(s), dtype=torch.long) for s in texts]  # "" (silence): none
    y = torch.nn.utils.rnn.pad_sequence(tokens, batch_first=True, padding_value=-1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        model(x, lens, y, torch.tensor([len(t) for t in tokens])).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return Recognizer(model.eval(), tokenizer, torch.device("cpu"))


def tone_checkpoint(path: Path, streaming: bool) -> Path:
    rec = train_model([speech(s, seed=i) for i, s in enumerate(SENTENCES)], SENTENCES, streaming)
    return save_checkpoint({"model_config": dataclasses.asdict(rec.model.cfg), "model": rec.model.state_dict(),
                            "tokenizer": rec.tokenizer.model_proto}, path)


class Server:
    """A ``konkanivani-serve`` process; ``url`` is where it listens, ``log`` what it wrote to stderr."""

    def __init__(self, checkpoint: Path, *flags: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "konkanivani.cli.serve", str(checkpoint), "--port", "0",
                                      *flags], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
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
def served(checkpoint: Path, *flags: str):
    server = Server(checkpoint, *flags)
    try:
        yield server
    finally:
        server.stop()


def http(method: str, url: str, body: bytes | None = None, headers: dict | None = None,
         timeout: float = 60) -> tuple[int, Message, bytes]:
    """(status, headers (case-insensitive), body) of one request, an error status included."""
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
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"{field}\"; filename=\"{filename}\"\r\n"
            f"Content-Type: application/octet-stream\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
    return body, {"Content-Type": f"multipart/form-data; boundary={boundary}"}


def wait_until(condition, seconds: float, every: float = 0.1) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(every)
    return condition()


def ws_session(url: str, frames, then: str = "end", headers: dict | None = None, pause: float = 0.0,
               timeout: float = 60) -> tuple[list[dict], dict]:
    """Send ``frames`` (bytes: binary, str: text) over a WebSocket, then (``then``) ``{"type": "end"}``,
    or hang up, or wait for the server to close; the JSON messages received (read by a thread as they
    come) and ``{"code", "reason"}`` of the close frame received."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    messages, closed = [], {}
    with connect(url, additional_headers=headers, open_timeout=timeout, close_timeout=timeout, max_size=None) as ws:
        def read():
            try:
                while True:
                    messages.append(json.loads(ws.recv(timeout=timeout)))
            except ConnectionClosed as e:
                closed.update(code=e.rcvd.code if e.rcvd else None, reason=e.rcvd.reason if e.rcvd else "")
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


def ws_refusal(url: str, headers: dict | None = None, timeout: float = 30):
    """The HTTP answer (status, headers, body) that refused a WebSocket handshake; None if it opened."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    try:
        with connect(url, additional_headers=headers, open_timeout=timeout, close_timeout=timeout):
            return None
    except InvalidStatus as e:
        return e.response.status_code, e.response.headers, json.loads(e.response.body or b"{}")
