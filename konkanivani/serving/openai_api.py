"""OpenAI's dialect of the server's API, on the same app, token, origin check and limits as
``POST /transcribe``:

    POST /v1/audio/transcriptions   a multipart form (file, model, response_format, ...) -> the
                                    transcript as OpenAI answers it: json, text, srt, vtt or
                                    verbose_json
    GET  /v1/models                 the one model served, as OpenAI lists models
    GET  /v1/models/{model}         that model, or 404 model_not_found

so that OpenAI's clients (the ``openai`` package and the tools built on it) use the server by its
base URL ``http://HOST:PORT/v1``, with the server's token as their API key. Every refusal is
OpenAI's error JSON, ``{"error": {"message", "type", "param", "code"}}``, with the status code and
the Retry-After of the server's own endpoints (which OpenAI's clients honour when they retry); a
path under /v1 that is none of these is 404 ``Invalid URL (METHOD PATH)``, as OpenAI answers it.

The server holds one model: a request's ``model`` may name any (tools that send a fixed name, such
as ``whisper-1``, work unchanged) and is answered by the model served, which ``/v1/models`` names.
``language`` and ``temperature`` are accepted and do not change the decoding (the model knows one
language and decodes without sampling); ``prompt``, ``keywords[]`` and this server's own
``hotwords`` field are read as hotwords. What is OpenAI's and what is not: docs/serving.md.
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
import time
import zlib
from typing import TYPE_CHECKING

from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from ..data.tokenizer import normalize_text
from ..decoding.alignment import Word
from ..decoding.hotwords import (
    MAX_HOTWORD_CHARS,
    HotwordError,
    hotword_tokens,
    parse_hotword,
    split_hotwords,
)
from ..decoding.settings import HOTWORD_METHODS
from ..decoding.streaming import Result
from ..decoding.subtitles import subtitles
from .uploads import Refused, read_body, read_form

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

__all__ = ["LANGUAGE", "RESPONSE_FORMATS", "TRANSCRIPTIONS", "error_response", "routes"]

TRANSCRIPTIONS = "/v1/audio/transcriptions"
RESPONSE_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
GRANULARITIES = ("segment", "word")
# what verbose_json's language says: Whisper names a language in English words, in lower case
LANGUAGE = "konkani"
# the names a request's language may give Konkani by: ISO 639-2 (kok) and 639-3 (gom: Goan, knn:
# Maharashtrian Konkani); ISO 639-1 has no code for it
_KONKANI = {"kok", "gom", "knn", "konkani"}
_SUBTITLES = {"srt": "application/x-subrip; charset=utf-8", "vtt": "text/vtt; charset=utf-8"}
# fields besides file: the form's own, its lists sent one field a value (hotwords[]: hundreds)
_MAX_FIELDS = 1000
_ALL_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
# OpenAI's codes for the server's refusals that have one; the others keep the server's reason
_CODES = {"token": "invalid_api_key", "client_busy": "rate_limit_exceeded",
          "model": "model_not_found", "no_route": None}
# the request's field a refusal is about, where its reason says
_PARAMS = {"empty": "file", "audio": "file", "too_long": "file", "too_large": "file"}
OWNER = "konkanivani"
# what a transcription ignored of its request (language, a prompt the model cannot take)
NOTE_HEADER = "X-Konkanivani-Note"
MAX_HOTWORDS = 1000  # a request's, with its prompt's words
# ... and their tokens, as the model's tokenizer spells them (the nodes of their graph)
MAX_HOTWORD_TOKENS = 10_000
# The characters of a request's hotwords, keywords and prompt together, counted before they are
# split (24 MB of them split on the event loop held /health 17.6 s): MAX_HOTWORDS lines of
# MAX_HOTWORD_CHARS, a boost and a separator each.
MAX_HOTWORDS_TEXT = MAX_HOTWORDS * (MAX_HOTWORD_CHARS + 10)


@dataclasses.dataclass(frozen=True)
class Ask:
    """What a transcription request asks, its fields read and checked (``parse_fields``)."""

    response_format: str = "json"
    granularities: tuple[str, ...] = ("segment",)
    model: str = ""
    language: str = ""
    prompt: str = ""
    hotwords: tuple[str, ...] = ()
    temperature: float = 0.0

    @property
    def other_language(self) -> bool:
        """Whether the request named a language other than the model's."""
        return bool(self.language) and self.language.strip().lower() not in _KONKANI

    def hotword_lines(self, engine) -> tuple[tuple[str, ...], list[str]]:
        """The hotword lines the request asks ``engine`` (``serving.engine.Engine``) to decode
        with, and notes of what it ignored: the lines of ``hotwords`` and ``keywords`` (400 for
        one that is no hotword, for more than ``MAX_HOTWORDS`` or ``MAX_HOTWORD_TOKENS``, or for a
        model whose search takes none), and each word of ``prompt`` at the default boost where the
        model's search takes hotwords (else ignored, noted)."""
        why_not = _no_hotwords(engine)
        notes = []
        lines = list(self.hotwords)
        if lines and why_not:
            raise Refused(400, "hotwords", f"hotwords: {why_not}", param="hotwords")
        if self.prompt and why_not:
            notes.append(f"prompt ignored: {why_not}")
        elif self.prompt:
            # a prompt's words are no hotword lines: normalized, no boost mark is left in them
            lines += normalize_text(self.prompt).split()
        lines = list(dict.fromkeys(lines))
        if len(lines) > MAX_HOTWORDS:  # counted before any is parsed
            raise Refused(400, "hotwords", f"{len(lines)} hotwords (with the prompt's words): at "
                          f"most {MAX_HOTWORDS} a request", param="hotwords")
        for line in lines:
            try:
                parse_hotword(line)
            except HotwordError as e:
                raise Refused(400, "hotwords", f"hotwords {line[:60]!r}: {e}",
                              param="hotwords") from None
        tokens = hotword_tokens(lines, engine.recognizer.tokenizer) if lines else 0
        if tokens > MAX_HOTWORD_TOKENS:
            raise Refused(400, "hotwords", f"the hotwords (with the prompt's words) spell "
                          f"{tokens} tokens: at most {MAX_HOTWORD_TOKENS} a request",
                          param="hotwords")
        return tuple(lines), notes


def _no_hotwords(engine) -> str:
    """Why ``engine`` cannot decode with hotwords; "" when it can."""
    if engine.exported:
        return "this server's model is an ONNX export, which decodes without hotwords"
    if engine.decoding.method not in HOTWORD_METHODS:
        return (f"this server decodes with {engine.decoding.method}, which takes no hotwords "
                f"(only {', '.join(HOTWORD_METHODS)} do: konkanivani-serve --method)")
    return ""


def routes(server) -> list[Route]:
    """The routes of OpenAI's dialect for ``server`` (``app._Server``: its ``guard``,
    ``upload_place``, ``decode_upload``, ``limits``, ``metrics`` and ``model_name``)."""
    dialect = _Dialect(server)

    def guarded(endpoint: str, handler: Callable[[Request], Awaitable[Response]]):
        return server.guard(endpoint, handler, error_response)

    return [
        Route(TRANSCRIPTIONS, guarded(TRANSCRIPTIONS, dialect.transcriptions), methods=["POST"]),
        Route("/v1/models", guarded("/v1/models", dialect.models), methods=["GET"]),
        # a model's id may hold a slash (the default names its folder and file)
        Route("/v1/models/{model:path}", guarded("/v1/models", dialect.model), methods=["GET"]),
        # last: any other path under /v1, or a method a route above does not take
        Route("/v1/{rest:path}", guarded("/v1", dialect.no_route), methods=_ALL_METHODS),
    ]


class _Dialect:
    def __init__(self, server):
        self.server = server
        self.created = int(time.time())  # the model's "created": when the server started

    @property
    def model_id(self) -> str:
        return self.server.model_name or OWNER

    def _model(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created,
                "owned_by": OWNER}

    async def models(self, request: Request) -> Response:
        self.server.metrics.requests.labels("/v1/models", "200").inc()
        return JSONResponse({"object": "list", "data": [self._model()]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name != self.model_id:
            raise Refused(404, "model", f"The model '{name[:200]}' does not exist: this server "
                          f"serves '{self.model_id}'", param="model")
        self.server.metrics.requests.labels("/v1/models", "200").inc()
        return JSONResponse(self._model())

    async def no_route(self, request: Request) -> Response:
        raise Refused(404, "no_route", f"Invalid URL ({request.method} {request.url.path[:200]}): "
                      f"this server answers POST {TRANSCRIPTIONS}, GET /v1/models and GET "
                      "/v1/models/{model}")

    async def transcriptions(self, request: Request) -> Response:
        server = self.server
        with server.upload_place(request):
            ask, data = await self._read(request)
            # parsing and tokenizing up to MAX_HOTWORDS lines: on a thread, the event loop free
            hotwords, notes = await asyncio.to_thread(ask.hotword_lines, server.engine)
            if ask.other_language:
                notes.insert(0, f"language {ask.language[:20]!r} ignored: the model transcribes "
                             f"{LANGUAGE}")
            results, seconds, _ = await server.decode_upload(data, TRANSCRIPTIONS, hotwords)
            server.metrics.requests.labels(TRANSCRIPTIONS, "200").inc()
            response = render(ask, results, seconds)
            if notes:
                response.headers[NOTE_HEADER] = "; ".join(notes)
            return response

    async def _read(self, request: Request) -> tuple[Ask, bytes]:
        """The request's fields and its file's bytes, read within the server's limits."""
        if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
            raise Refused(400, "form", "the request must be a multipart/form-data form with the "
                          "audio in its field 'file'", param="file")
        limits = self.server.limits
        body = await read_body(request, limits)
        form = await read_form(request, body, limits, max_fields=_MAX_FIELDS)
        try:
            ask = await asyncio.to_thread(parse_fields, form)
            upload = form.get("file")
            if upload is None or isinstance(upload, str):
                raise Refused(400, "empty", "no audio: the form needs the file in its field "
                              "'file' (a file part, with a filename)", param="file")
            data = await upload.read()
        finally:
            await form.close()
        if not data:
            raise Refused(400, "empty", "no audio: the field 'file' is empty", param="file")
        return ask, data


def parse_fields(form: FormData) -> Ask:
    """The fields of a transcription form, checked: 400 naming the field that is wrong. Fields
    this server does not use (chunking_strategy, include[], ...) are ignored, as are unknown
    ones."""

    def text(name: str) -> str:
        value = form.get(name)
        if value is None:
            return ""
        if not isinstance(value, str):
            raise Refused(400, "params", f"'{name}' must be a text field, not a file", param=name)
        return value.strip()

    def texts(name: str) -> list[str]:
        # OpenAI's clients send a list as one field a value, named with brackets
        values = [*form.getlist(name), *form.getlist(f"{name}[]")]
        if any(not isinstance(v, str) for v in values):
            raise Refused(400, "params", f"'{name}' must be text fields, not files", param=name)
        return [v.strip() for v in values if v.strip()]

    # counted before any is split or parsed
    size = sum(len(v) for name in ("hotwords", "keywords", "prompt")
               for v in (*form.getlist(name), *form.getlist(f"{name}[]")) if isinstance(v, str))
    if size > MAX_HOTWORDS_TEXT:
        raise Refused(400, "hotwords", f"hotwords, keywords and prompt hold {size} characters: at "
                      f"most {MAX_HOTWORDS_TEXT} in a request ({MAX_HOTWORDS} hotwords of "
                      f"{MAX_HOTWORD_CHARS})", param="hotwords")

    response_format = text("response_format") or "json"
    if response_format not in RESPONSE_FORMATS:
        raise Refused(400, "params", f"response_format {response_format[:40]!r} is not one of "
                      f"{', '.join(RESPONSE_FORMATS)}", param="response_format")
    granularities = texts("timestamp_granularities")
    for g in granularities:
        if g not in GRANULARITIES:
            raise Refused(400, "params", f"timestamp_granularities: {g[:40]!r} is not one of "
                          f"{', '.join(GRANULARITIES)}", param="timestamp_granularities")
    if granularities and response_format != "verbose_json":
        raise Refused(400, "params", "timestamp_granularities need response_format=verbose_json "
                      f"(got {response_format})", param="timestamp_granularities")
    temperature = text("temperature") or "0"
    try:
        value = float(temperature)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise Refused(400, "params", f"temperature must be a number, got {temperature[:40]!r}",
                      param="temperature")
    if text("stream").lower() in ("true", "1"):
        raise Refused(400, "params", "stream is not offered here: the whole transcript comes in "
                      "one answer; the WebSocket /stream gives results as they come",
                      param="stream")
    # this server's hotwords: lines (comma- or line-separated); OpenAI's keywords[]: one a field
    hotwords = [line for value in texts("hotwords") for line in split_hotwords(value)]
    hotwords += texts("keywords")
    return Ask(response_format=response_format,
               granularities=tuple(dict.fromkeys(granularities)) or ("segment",),
               model=text("model"), language=text("language"), prompt=text("prompt"),
               hotwords=tuple(hotwords), temperature=value)


def render(ask: Ask, results: list[Result], seconds: float) -> Response:
    """The answer of a transcription in ``ask.response_format``: the final results of the upload
    (``Engine.transcribe``) and its seconds of audio. Segments are the results with text."""
    segments = [r for r in results if r.text]
    text = " ".join(r.text for r in segments)
    usage = {"type": "duration", "seconds": round(seconds, 3)}
    kind = ask.response_format
    if kind == "json":
        return JSONResponse({"text": text, "usage": usage})
    if kind == "text":
        return PlainTextResponse(text + "\n")
    if kind in _SUBTITLES:
        # cues cut between words, at most 2 lines of 42 characters and 6 s (decoding.subtitles)
        return Response(subtitles(segments, kind), media_type=_SUBTITLES[kind])
    verbose = {"task": "transcribe", "language": LANGUAGE, "duration": round(seconds, 3),
               "text": text}
    if "segment" in ask.granularities:
        verbose["segments"] = [_segment(i, r) for i, r in enumerate(segments)]
    if "word" in ask.granularities:
        verbose["words"] = [_word(w) for r in segments for w in r.words]
    verbose["usage"] = usage
    return JSONResponse(verbose)


def _word(w: Word) -> dict:
    """A word as OpenAI's verbose_json has it, with its ``probability`` (from the CTC alignment,
    as faster-whisper's servers give it) where the word has one."""
    word = {"word": w.text, "start": w.start, "end": w.end}
    if w.probability is not None:
        word["probability"] = round(w.probability, 4)
    return word


def _segment(i: int, r: Result) -> dict:
    """A segment as OpenAI's verbose_json has it. ``avg_logprob`` is the mean log probability of
    its words (``avg_logprob``); Whisper's fields that a CTC model has no value for are fixed:
    ``tokens`` empty (this model's token ids are of its own vocabulary, which no OpenAI client
    reads), ``temperature`` 0 (no sampling), ``no_speech_prob`` 0 (a segment is one with words);
    ``seek`` is the segment's start in Whisper's 10 ms frames, and ``compression_ratio`` the
    text's, as Whisper computes it (zlib)."""
    return {"id": i, "seek": round(r.start * 100), "start": r.start, "end": r.end,
            "text": r.text, "tokens": [], "temperature": 0.0, "avg_logprob": avg_logprob(r.words),
            "compression_ratio": compression_ratio(r.text), "no_speech_prob": 0.0}


def avg_logprob(words: list[Word]) -> float:
    """The mean natural log of the words' probabilities (each floored at 1e-10: no -inf), the
    likeness of Whisper's mean token log probability (below -1: Whisper's clients take the segment
    as doubtful); 0 where no word has one (an ONNX export's windows)."""
    logs = [math.log(max(w.probability, 1e-10)) for w in words if w.probability is not None]
    return round(sum(logs) / len(logs), 4) if logs else 0.0


def compression_ratio(text: str) -> float:
    """Whisper's: the text's UTF-8 bytes over their zlib-compressed bytes (a repeating text
    compresses well: Whisper takes above 2.4 as a decoding gone round in a loop)."""
    data = text.encode("utf-8")
    return round(len(data) / len(zlib.compress(data)), 4) if data else 0.0


def error_response(e: Refused) -> JSONResponse:
    """A refusal in OpenAI's error JSON, with its status and headers: ``type`` is
    ``invalid_request_error`` for a 4xx (``requests`` for a 429, as OpenAI's rate limits say),
    ``server_error`` for a 5xx; ``code`` OpenAI's where it has one (invalid_api_key,
    rate_limit_exceeded, model_not_found), else the server's reason (too_large, busy, ...)."""
    kind = ("server_error" if e.status >= 500 else "requests" if e.status == 429
            else "invalid_request_error")
    error = {"message": e.message, "type": kind, "param": e.param or _PARAMS.get(e.reason),
             "code": _CODES.get(e.reason, e.reason)}
    return JSONResponse({"error": error}, e.status, headers=e.headers)
