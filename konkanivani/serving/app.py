"""The server's ASGI app (Starlette): routes, the token check, limits and metrics.

    POST /transcribe   an audio file (the raw body, or the first file of a multipart form) -> JSON
    WS   /stream       16-bit PCM or float32 frames in -> partial and final results as JSON text
    GET  /             the page (static/): microphone, live results, a file drop
    GET  /health       {"status": "ok", ...}
    GET  /metrics      Prometheus text
    /v1/...            OpenAI's dialect (openai_api): POST /v1/audio/transcriptions, GET /v1/models

A request whose ``Host`` is none of the names the server is reached by on purpose (``LOCAL_HOSTS``,
its bound address, ``--allow_host``) is 400 before any endpoint, token or not: a foreign name that
resolves to this machine (DNS rebinding) would otherwise be the page's own origin.

With a token, every request carries it: ``Authorization: Bearer TOKEN``, the query parameter
``token=TOKEN`` (what a WebSocket client without headers can send) or the cookie the page's
``/?token=TOKEN`` sets; else 401 (for ``/stream``, the handshake's answer). A request that carries
an ``Origin`` (a browser's) must come from the server's own origin or one of ``allow_origins``, else
403 even with the cookie: a page of another port on the same host is the same *site*, so the
cookie's SameSite=Strict does not keep it out. Nothing a client sends names a file the server
opens: uploads are read in memory, the page's files are read from the package once. The protocol
and the limits: docs/serving.md.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hmac
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from importlib import resources
from pathlib import PurePath
from typing import Any

import numpy as np
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from ..data.audio import AudioError
from ..data.frames import SAMPLE_RATE
from ..decoding.streaming import MAX_RATE, MIN_RATE, Result, check_sample_rate
from . import openai_api
from .engine import Engine, UploadTooLong
from .limits import Limits
from .uploads import Refused, escape_controls, upload_bytes

__all__ = ["FORMATS", "LOCAL_HOSTS", "TOKEN_COOKIE", "DenialLogFilter", "EscapeFields",
           "create_app"]

log = logging.getLogger("konkanivani")

TOKEN_COOKIE = "konkanivani_token"
# the names this machine reaches the server by, whatever it is bound to (any port)
LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]")
# a stream's sample formats, little-endian
FORMATS = {"pcm16": np.dtype("<i2"), "float32": np.dtype("<f4")}
_STATIC = {
    "app.js": "text/javascript",
    "capture-worklet.js": "text/javascript",
    "style.css": "text/css",
    "index.html": "text/html; charset=utf-8",
}
_PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; connect-src 'self' ws: wss:; img-src 'self' data:"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
# set in the task of a WebSocket connection whose handshake this app refused (DenialLogFilter)
_denied = contextvars.ContextVar("konkanivani_denied", default=False)


class _Metrics:
    """The server's Prometheus metrics, in a registry of its own (two apps in one process count
    apart)."""

    def __init__(self, engine: Engine | None = None):
        self.registry = r = CollectorRegistry()
        if engine is not None:
            r.register(_BusyCollector(engine))
        self.requests = Counter(
            "konkanivani_requests",
            "Requests answered, by endpoint and status code",
            ["endpoint", "code"],
            registry=r,
        )
        self.errors = Counter(
            "konkanivani_errors",
            "Requests refused or failed (4xx, 5xx, a stream closed on an "
            "error), by endpoint and reason",
            ["endpoint", "reason"],
            registry=r,
        )
        self.active_streams = Gauge(
            "konkanivani_active_streams", "WebSocket streams open", registry=r
        )
        self.audio_seconds = Counter(
            "konkanivani_audio_seconds", "Seconds of audio decoded", ["endpoint"], registry=r
        )
        self.decode_seconds = Counter(
            "konkanivani_decode_seconds", "Seconds spent decoding", ["endpoint"], registry=r
        )
        self.rtf = Histogram(
            "konkanivani_real_time_factor",
            "Decoding time over audio time, per upload or stream",
            ["endpoint"],
            buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0),
            registry=r,
        )
        self.partial_latency = Histogram(
            "konkanivani_partial_latency_seconds",
            "From a stream's frame arriving to the results it brought being sent",
            registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0),
        )

    def decoded(self, endpoint: str, audio_s: float, decode_s: float) -> None:
        self.audio_seconds.labels(endpoint).inc(audio_s)
        self.decode_seconds.labels(endpoint).inc(decode_s)
        if audio_s > 0:
            self.rtf.labels(endpoint).observe(decode_s / audio_s)


class _BusyCollector:
    """``konkanivani_decode_thread_seconds_total``: the seconds the decode threads spent working
    (``Engine.busy_seconds``), every request's together. Over the audio seconds it is the server's
    real-time factor as its CPU sees it; ``konkanivani_decode_seconds`` counts each request's wait
    for a decode thread (and a batched stream's tick until its results) as well."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        family = CounterMetricFamily(
            "konkanivani_decode_thread_seconds",
            "Seconds the decode threads spent working, all requests together",
        )
        family.add_metric([], self.engine.busy_seconds)
        yield family


class DenialLogFilter(logging.Filter):
    """For uvicorn's ``uvicorn.error`` log: drops its "ASGI callable returned without completing
    handshake" after a handshake this app refused with an HTTP answer. Its websockets-sansio
    protocol logs that error for every such refusal though the client got the answer
    (Kludex/uvicorn#3138); the record is dropped only in the refused connection's own task, so a
    real one still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        uvicorns = message.startswith("ASGI callable returned without completing")
        return not (_denied.get() and uvicorns)


class EscapeFields(logging.Filter):
    """For a handler of konkanivani's log: control characters in a record's fields (its args: what
    a client sent, a hotword say) written as escapes (``\\x1b``, ``\\n``), so that no client
    forges a log line or moves a terminal's cursor. The message's own text is the code's."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(escape_controls(a) if isinstance(a, str) else a
                                for a in record.args)
        return True


def _static_files() -> dict[str, bytes]:
    """The page's files, read from the package once: the only files the server serves."""
    folder = resources.files(__package__) / "static"
    return {name: (folder / name).read_bytes() for name in _STATIC}


def create_app(engine: Engine, limits: Limits = Limits(), token: str | None = None,
               model_name: str = "", allow_origins: Iterable[str] = (),
               hosts: Iterable[str] = ()) -> Starlette:
    """The app of one loaded model: see the module. ``token`` None or empty: no token asked;
    ``allow_origins``: origins besides its own whose pages may use it (``scheme://host[:port]``);
    ``hosts``: the names (or addresses) it answers besides ``LOCAL_HOSTS``."""
    server = _Server(engine, limits, token, model_name, allow_origins)
    guard = server.guard
    routes = [
        Route("/", guard("/static", server.page)),
        Route("/static/{name}", guard("/static", server.page)),
        Route("/health", guard("/health", server.health)),
        Route("/metrics", guard("/metrics", server.metrics_page)),
        Route("/transcribe", guard("/transcribe", server.transcribe), methods=["POST"]),
        WebSocketRoute("/stream", guard("/stream", server.stream)),
        # OpenAI's dialect, behind the same checks, answering refusals in OpenAI's error JSON
        *openai_api.routes(server),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        engine.close()

    # Before any endpoint, with or without a token: a request whose Host names another (a foreign
    # name the page's DNS points at 127.0.0.1: DNS rebinding) is 400. Its own origin, which the
    # Origin check derives from Host, is then one of these names too.
    trusted = Middleware(_TrustedHosts, allowed_hosts=[*LOCAL_HOSTS, *hosts], www_redirect=False)
    app = Starlette(routes=routes, lifespan=lifespan, middleware=[trusted])
    app.state.metrics = server.metrics
    return app


class _TrustedHosts(TrustedHostMiddleware):
    """Starlette's, its 400 to a WebSocket handshake marked as this app's refusal
    (``DenialLogFilter``)."""

    async def __call__(self, scope, receive, send) -> None:
        async def marked(message) -> None:
            if message["type"] == "websocket.http.response.start":
                _denied.set(True)
            await send(message)

        await super().__call__(scope, receive, marked if scope["type"] == "websocket" else send)


class _Server:
    """The handlers of one loaded model. Each does its own work and raises ``Refused`` to refuse;
    ``guard`` puts the origin and token checks in front of each and answers every refusal,
    counted."""

    def __init__(self, engine: Engine, limits: Limits, token: str | None, model_name: str,
                 allow_origins: Iterable[str] = ()):
        self.engine, self.limits, self.token, self.model_name = engine, limits, token, model_name
        self.allow_origins = {normalize_origin(o) for o in allow_origins}
        self.metrics, self.static, self.started = (_Metrics(engine), _static_files(),
                                                   time.monotonic())
        self.streams = self.uploads = 0  # open and decoding now
        # by client address: uploads being read or decoded, streams open
        self.client_uploads: dict[str, int] = {}
        self.client_streams: dict[str, int] = {}

    def guard(self, endpoint: str, handler: Callable[[Any], Awaitable[Response | None]],
              answer: Callable[[Refused], Response] | None = None
              ) -> Callable[[Any], Awaitable[Response | None]]:
        """``handler`` behind the origin and token checks; a ``Refused`` (theirs or the handler's
        own) answered with its status and ``{"error": ...}`` (for the WebSocket, the handshake's
        HTTP answer), or with what ``answer`` makes of it, counted in ``endpoint``'s requests and
        errors."""

        async def guarded(conn: Request | WebSocket) -> Response | None:
            try:
                self.check_origin(conn)
                self.check_token(conn)
                return await handler(conn)
            except Refused as e:
                self.metrics.requests.labels(endpoint, str(e.status)).inc()
                self.metrics.errors.labels(endpoint, e.reason).inc()
                if isinstance(conn, WebSocket):
                    await _deny(conn, e)
                    return None
                if answer is not None:
                    return answer(e)
                return JSONResponse({"error": e.message}, e.status, headers=e.headers)

        return guarded

    def check_origin(self, conn: HTTPConnection) -> None:
        """403 for a browser's request from a page of another origin than the server's own (the
        scheme, host and port the request came to) and ``allow_origins``. A request without
        ``Origin`` is no page's (curl, programs): the token alone decides."""
        origin = conn.headers.get("origin")
        if origin is None:
            return
        scheme = conn.scope.get("scheme", "http")
        scheme = {"ws": "http", "wss": "https"}.get(scheme, scheme)
        own = f"{scheme}://{conn.headers.get('host', '')}"
        if normalize_origin(origin) not in (normalize_origin(own), *self.allow_origins):
            raise Refused(403, "origin", f"the page of another origin ({origin[:100]}) may not "
                          "use this server: only its own page, and those of --allow_origin")

    def check_token(self, conn: HTTPConnection) -> None:
        if not self.token:
            return
        given = conn.headers.get("authorization", "")
        given = given[7:] if given.lower().startswith("bearer ") else ""
        given = given or conn.query_params.get("token", "") or conn.cookies.get(TOKEN_COOKIE, "")
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            raise Refused(
                401,
                "token",
                "this server needs its token: the header 'Authorization: Bearer TOKEN', "
                "or ?token=TOKEN",
                {"WWW-Authenticate": "Bearer"},
            )

    def busy(self, what: str, limit: int) -> Refused:
        return Refused(
            503,
            "busy",
            f"{limit} {what} already: the most this server takes at once; try again in "
            f"{self.limits.retry_after_s} s",
            {"Retry-After": str(self.limits.retry_after_s)},
        )

    @contextlib.contextmanager
    def per_client(self, conn: HTTPConnection, counts: dict[str, int], what: str,
                   limit: int) -> Iterator[None]:
        """One of ``counts``' places of the client's address while the block runs; 429 when it
        holds ``limit`` already. (Behind a proxy every client has the proxy's address.)"""
        client = conn.client.host if conn.client else ""
        if counts.get(client, 0) >= limit:
            retry = self.limits.retry_after_s
            raise Refused(429, "client_busy", f"this client ({client}) has {limit} {what} "
                          "already: the most one address may have at once; try again in "
                          f"{retry} s", {"Retry-After": str(retry)})
        counts[client] = counts.get(client, 0) + 1
        try:
            yield
        finally:
            counts[client] -= 1
            if not counts[client]:
                del counts[client]

    async def health(self, request: Request) -> Response:
        self.metrics.requests.labels("/health", "200").inc()
        return JSONResponse(
            {
                "status": "ok",
                "model": self.model_name,
                **self.engine.description,
                **self.engine.notes,
                "active_streams": self.streams,
                "max_streams": self.limits.max_streams,
                "uptime_s": round(time.monotonic() - self.started, 1),
            }
        )

    async def metrics_page(self, request: Request) -> Response:
        self.metrics.requests.labels("/metrics", "200").inc()
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def page(self, request: Request) -> Response:
        name = request.path_params.get("name", "index.html")
        if name not in _STATIC:  # a name, looked up in a fixed table: never a path
            raise Refused(404, "not_found", "no such file")
        response = Response(self.static[name], media_type=_STATIC[name], headers=_PAGE_HEADERS)
        if self.token and hmac.compare_digest(
            request.query_params.get("token", "").encode(), self.token.encode()
        ):
            # the page's later requests (its files, uploads, the WebSocket's handshake) carry it
            response.set_cookie(TOKEN_COOKIE, self.token, httponly=True, samesite="strict")
        return response

    async def transcribe(self, request: Request) -> Response:
        with self.upload_place(request):
            data = await upload_bytes(request, self.limits)
            results, seconds, elapsed = await self.decode_upload(data, "/transcribe")
            self.metrics.requests.labels("/transcribe", "200").inc()
            return JSONResponse({"text": " ".join(r.text for r in results if r.text), "segments": [
                _result(r) for r in results], "duration": round(seconds, 3),
                "decode_seconds": round(elapsed, 3),
                "real_time_factor": round(elapsed / seconds, 4), **self.engine.description})

    def upload_place(self, request: Request) -> contextlib.AbstractContextManager[None]:
        """One of the client's places for uploads (``per_client``) while an upload is read and
        decoded: every upload endpoint takes one."""
        return self.per_client(request, self.client_uploads, "uploads in progress",
                               self.limits.max_client_uploads)

    async def decode_upload(self, data: bytes, endpoint: str, hotwords: tuple[str, ...] = ()
                            ) -> tuple[list[Result], float, float]:
        """The final results of an upload's bytes (``Engine.transcribe``, with a request's
        ``hotwords``), its seconds of audio and the seconds spent
        decoding it, counted in ``endpoint``'s metrics. 503 when ``max_uploads`` uploads are
        decoding, 413 and 400 for audio too long or unreadable, 500 if decoding fails."""
        # a decode place is taken only now, with the whole body in: a slow sender holds none
        if self.uploads >= self.limits.max_uploads:
            raise self.busy("uploads decoding", self.limits.max_uploads)
        self.uploads += 1
        try:
            return await self._decode_upload(data, endpoint, hotwords)
        finally:
            self.uploads -= 1

    async def _decode_upload(self, data: bytes, endpoint: str, hotwords: tuple[str, ...]
                             ) -> tuple[list[Result], float, float]:
        start = time.perf_counter()
        try:
            wav = await self.engine.run(
                self.engine.read_upload, data, self.limits.max_upload_seconds
            )
            del data
            results = await self.engine.run(self.engine.transcribe, wav, hotwords)
        except UploadTooLong as e:
            raise Refused(413, "too_long", str(e)) from e
        except AudioError as e:
            raise Refused(400, "audio", str(e)) from e
        # whatever the audio makes the model raise: this request fails alone
        except Exception as e:  # noqa: BLE001
            log.exception("decoding an upload failed")
            raise Refused(500, "decode", f"decoding failed ({type(e).__name__})") from e
        elapsed, seconds = time.perf_counter() - start, len(wav) / SAMPLE_RATE
        self.metrics.decoded(endpoint, seconds, elapsed)
        return results, seconds, elapsed

    async def stream(self, ws: WebSocket) -> None:
        sample_rate, dtype = _stream_params(ws)
        if not self.engine.streaming:
            raise Refused(
                409,
                "not_streaming",
                f"this model cannot stream ({self.engine.why_not_streaming}): "
                "POST the recording to /transcribe",
            )
        limits = self.limits
        with self.per_client(ws, self.client_streams, "streams open", limits.max_client_streams):
            if self.streams >= limits.max_streams:
                raise self.busy("streams open", limits.max_streams)
            # counted before the first await: no two handshakes take the last place
            self.streams += 1
            self.metrics.active_streams.inc()
            try:
                session = _Session(ws, self.engine, limits, self.metrics, sample_rate, dtype)
                code = await session.run()
            finally:
                self.streams -= 1
                self.metrics.active_streams.dec()
        self.metrics.requests.labels("/stream", str(code)).inc()


def normalize_origin(origin: str) -> str:
    """An origin as compared: lower case, without a trailing slash."""
    return origin.strip().rstrip("/").lower()


def _stream_params(ws: WebSocket) -> tuple[int, np.dtype]:
    """A stream's ``sample_rate`` (default ``SAMPLE_RATE``, 16 kHz) and ``format`` (``pcm16``, the
    default, or ``float32``)."""
    rate = ws.query_params.get("sample_rate", str(SAMPLE_RATE))
    fmt = ws.query_params.get("format", "pcm16")
    # ASCII digits alone: str.isdigit takes others too ("²", which int refuses: a 500)
    if not re.fullmatch(r"[0-9]{1,7}", rate) or not MIN_RATE <= int(rate) <= MAX_RATE:
        raise Refused(
            400,
            "params",
            f"sample_rate must be a whole number of Hz from {MIN_RATE} to {MAX_RATE}, "
            f"got {rate[:20]!r}",
        )
    try:
        check_sample_rate(int(rate))
    except ValueError as e:
        raise Refused(400, "params", f"sample_rate: {e}") from e
    if fmt not in FORMATS:
        raise Refused(
            400, "params", f"format must be one of {', '.join(FORMATS)}, got {fmt[:20]!r}"
        )
    return int(rate), FORMATS[fmt]


async def _deny(ws: WebSocket, e: Refused) -> None:
    """Refuse a WebSocket handshake with the HTTP answer of ``e`` (where the server can send one:
    uvicorn
    does), else with close code 1008 (or 1013 for a 503) and its message as the reason."""
    _denied.set(True)
    try:
        await ws.send_denial_response(
            JSONResponse({"error": e.message}, e.status, headers=e.headers)
        )
    except RuntimeError:
        await ws.close(1013 if e.status == 503 else 1008, _reason(e.message))


def _reason(message: str) -> str:
    """A close reason: at most 123 bytes of UTF-8 (the protocol's limit)."""
    data = message.encode()
    return message if len(data) <= 123 else data[:120].decode(errors="ignore") + "..."


def _result(r: Result, audio_seconds: float | None = None) -> dict:
    """A result as JSON; in a stream with its ``type`` and the seconds of audio the stream had taken
    when it was made (a client's clock for its latency)."""
    out = {} if audio_seconds is None else {"type": "final" if r.is_final else "partial"}
    out.update(text=r.text, start=r.start, end=r.end,
               words=[{"word": w.text, "start": w.start, "end": w.end} for w in r.words])
    if audio_seconds is not None:
        out["audio_seconds"] = round(audio_seconds, 3)
    return out


class _Close(Exception):
    """End a stream: its last results are sent first when ``finish``; then close ``code`` with
    ``reason``."""

    def __init__(self, code: int, reason: str, finish: bool = False, error: str | None = None):
        super().__init__(reason)
        self.code, self.reason, self.finish, self.error = code, reason, finish, error


class _Session:
    """One accepted stream: frames in, results out, until the client's ``{"type": "end"}`` (its last
    results, ``{"type": "done"}``, close 1000), a limit, a malformed message or a disconnect."""

    def __init__(
        self,
        ws: WebSocket,
        engine: Engine,
        limits: Limits,
        metrics: _Metrics,
        sample_rate: int,
        dtype: np.dtype,
    ):
        self.ws, self.engine, self.limits, self.metrics = ws, engine, limits, metrics
        self.sample_rate, self.dtype = sample_rate, dtype
        self.stream = engine.open_stream(sample_rate)
        self.samples = 0  # taken so far
        self.decode_s = 0.0
        self.opened = time.monotonic()  # set again once accepted

    async def run(self) -> int:
        """The close code the stream ended with."""
        await self.ws.accept()
        self.opened = time.monotonic()
        limits = self.limits
        # "format" is the samples' format the client asked for; the model's is "model_format"
        await self._send(
            {
                "type": "ready",
                "sample_rate": self.sample_rate,
                "format": _format_name(self.dtype),
                **self.engine.description,
                "max_stream_seconds": limits.max_stream_seconds,
                "idle_seconds": limits.idle_seconds,
                "min_stream_rate": limits.min_stream_rate,
                "grace_seconds": limits.grace_seconds,
                "max_frame_bytes": limits.max_frame_bytes,
            }
        )
        try:
            while True:
                await self._step()
        except WebSocketDisconnect:
            return 1001  # the client left: nothing to send it
        except _Close as close:
            if close.error:
                self.metrics.errors.labels("/stream", close.error).inc()
            try:
                if close.finish:
                    await self._decode(self.engine.stream_finish, self.stream)
                    await self._send({"type": "done", "audio_seconds": round(self._seconds, 3),
                                      "decode_seconds": round(self.decode_s, 3)})
                await self.ws.close(close.code, _reason(close.reason))
            except (WebSocketDisconnect, OSError, RuntimeError):
                pass  # gone meanwhile
            return close.code
        finally:
            self.metrics.decoded("/stream", self._seconds, self.decode_s)

    @property
    def _seconds(self) -> float:
        return self.samples / self.sample_rate

    async def _step(self) -> None:
        limits = self.limits
        # The moment the stream's audio falls below min_stream_rate of its time since it opened,
        # after the grace: a client sending a sample now and then holds no place. The server's own
        # decoding time (the frames wait meanwhile) is not counted against it.
        behind = self.opened + self.decode_s + max(limits.grace_seconds,
                                                   self._seconds / limits.min_stream_rate)
        try:
            wait = min(limits.idle_seconds, behind - time.monotonic())
            message = await asyncio.wait_for(self.ws.receive(), max(wait, 0))
        except asyncio.TimeoutError:
            if time.monotonic() >= behind:
                raise _Close(1008, f"too slow: {self._seconds:.1f} s of audio in "
                             f"{time.monotonic() - self.opened:.1f} s; this server needs at least "
                             f"{limits.min_stream_rate:g} of real time", finish=True,
                             error="too_slow") from None
            raise _Close(1008, f"no audio for {limits.idle_seconds:g} s: stream closed",
                         finish=True, error="idle") from None
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", 1000))
        data, text = message.get("bytes"), message.get("text")
        if data is None:
            if _is_end(text):
                raise _Close(1000, "end of stream", finish=True)
            raise _Close(
                1003,
                'text frames take only {"type": "end"}; audio comes in binary frames',
                error="text_frame",
            )
        if len(data) > self.limits.max_frame_bytes:
            raise _Close(
                1009,
                f"a frame of {len(data)} bytes: at most {self.limits.max_frame_bytes} a frame",
                error="frame_too_big",
            )
        samples = _samples(data, self.dtype)  # raises _Close 1007
        room = round(self.limits.max_stream_seconds * self.sample_rate) - self.samples
        self.samples += min(len(samples), room)
        if len(samples) >= room:
            await self._decode(self.engine.stream_accept, self.stream, samples[:room])
            raise _Close(
                1008,
                f"the stream reached {self.limits.max_stream_seconds:g} s, the most this server "
                "takes in one stream",
                finish=True,
                error="too_long",
            )
        arrived = time.perf_counter()
        if await self._decode(self.engine.stream_accept, self.stream, samples):
            self.metrics.partial_latency.observe(time.perf_counter() - arrived)

    async def _decode(self, fn, *args) -> int:
        """``await fn(*args)``, the engine's ``stream_accept`` or ``stream_finish`` of this stream,
        and send its results; how many."""
        start = time.perf_counter()
        try:
            results = await fn(*args)
        except Exception as e:  # noqa: BLE001  this stream fails alone; the server goes on
            log.exception("decoding a stream failed")
            raise _Close(1011, f"decoding failed ({type(e).__name__})", error="decode") from e
        finally:
            self.decode_s += time.perf_counter() - start
        for r in results:
            await self._send(_result(r, self._seconds))
        return len(results)

    async def _send(self, message: dict) -> None:
        try:
            await self.ws.send_text(json.dumps(message, ensure_ascii=False))
        except (OSError, RuntimeError) as e:  # the socket closed under us: as a disconnect
            raise WebSocketDisconnect(1006) from e


def _is_end(text: str | None) -> bool:
    try:
        return json.loads(text or "") == {"type": "end"}
    except ValueError:
        return False


def _format_name(dtype: np.dtype) -> str:
    return next(name for name, d in FORMATS.items() if d == dtype)


def _samples(data: bytes, dtype: np.dtype) -> np.ndarray:
    """A frame's samples as float32 in [-1, 1]; ``_Close`` 1007 for one that holds no whole samples
    or non-finite ones (float32 beyond [-1, 1] is clipped)."""
    if len(data) % dtype.itemsize:
        raise _Close(
            1007,
            f"a {_format_name(dtype)} frame holds whole {dtype.itemsize}-byte samples; got "
            f"{len(data)} bytes",
            error="bad_frame",
        )
    samples = np.frombuffer(data, dtype)
    if dtype.kind == "i":
        return samples.astype(np.float32) / 32768.0
    if not np.isfinite(samples).all():
        raise _Close(1007, "a float32 frame holds NaN or infinite samples", error="bad_frame")
    return np.clip(samples, -1.0, 1.0).astype(np.float32)


def model_label(path: str) -> str:
    """How ``/health`` names the model: its file and folder, never the whole path."""
    p = PurePath(path)
    return f"{p.parent.name}/{p.name}" if p.parent.name else p.name
