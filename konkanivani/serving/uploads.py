"""What the server's HTTP endpoints share: ``Refused``, the answer of a request refused, and an
upload read within the limits (``Limits``): its body, size-capped and against slow senders, and its
multipart form, read in memory. ``POST /transcribe`` (app) and ``POST /v1/audio/transcriptions``
(openai_api) read their uploads with these, so both keep the same limits with the same answers."""
from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator

from starlette.datastructures import FormData
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect, Request

from .limits import Limits

__all__ = ["DETAIL_CHARS", "MAX_FIELD_BYTES", "PARSER_LOGGERS", "Refused", "escape_controls",
           "read_body", "read_form", "upload_bytes"]

log = logging.getLogger("konkanivani")
# A form's text field, in bytes: the largest a request needs is its hotwords (openai_api's
# MAX_HOTWORDS of MAX_HOTWORD_CHARS, in UTF-8); a larger one is refused as the parser reaches it.
MAX_FIELD_BYTES = 512 * 2 ** 10
# the most of a form parser's error a refusal quotes
DETAIL_CHARS = 120
# python-multipart's loggers (its module's name before 0.0.13, and since), which log each error it
# raises as a warning of its own: the server logs the refusal instead (read_form)
PARSER_LOGGERS = ("multipart", "python_multipart")


class Refused(Exception):
    """A request answered with ``status`` and its ``message``: counted under ``reason`` (the
    metrics' label), with ``headers``; ``param``, where one field of the request was wrong, names it
    (OpenAI's error JSON carries it)."""

    def __init__(self, status: int, reason: str, message: str, headers: dict | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message
        self.headers, self.param = headers or {}, param


async def upload_bytes(request: Request, limits: Limits) -> bytes:
    """The audio bytes of an upload: the body (``read_body``), or with a multipart form its first
    file; 400 when there is none."""
    body = await read_body(request, limits)
    if request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
        form = await read_form(request, body, limits)
        files = [v for _, v in form.multi_items() if not isinstance(v, str)]
        try:
            body = await files[0].read() if files else b""
        finally:
            await form.close()
    if not body:
        raise Refused(
            400,
            "empty",
            "no audio: send the file as the body, or as a file field of a multipart form",
        )
    return body


async def read_body(request: Request, limits: Limits) -> bytes:
    """A request's whole body: 413 past ``Limits.max_upload_bytes``, 408 when it comes too slowly
    (``_body``). Past the limit the rest of the body is read and dropped (up to ``_drain_limit``),
    so that a client still sending it gets the 413 rather than a reset."""
    limit = limits.max_upload_bytes
    length = request.headers.get("content-length", "")
    too_big = Refused(
        413, "too_large", f"the upload is larger than this server takes ({limit / 2 ** 20:g} MB)"
    )
    if length.isdigit() and int(length) > _drain_limit(limit):
        raise too_big
    body, seen = bytearray(), 0
    async for piece in _body(request, limits):
        seen += len(piece)
        if seen > _drain_limit(limit):
            raise too_big
        if seen <= limit:
            body += piece
    if seen > limit:
        raise too_big
    return bytes(body)


async def read_form(request: Request, body: bytes, limits: Limits, max_files: int = 1,
                    max_fields: int = 8) -> FormData:
    """The multipart form of a ``body`` read whole, its parts in memory; 400 when it is malformed
    (or holds more than ``max_files`` files or ``max_fields`` fields, or a text field of more than
    ``MAX_FIELD_BYTES``: Starlette's parser counts them as it reads). Close it when done."""

    async def once():
        yield body

    parser = MultiPartParser(request.headers, once(), max_files=max_files, max_fields=max_fields,
                             max_part_size=MAX_FIELD_BYTES)
    # parts stay in memory: nothing an upload holds goes to disk
    parser.spool_max_size = limits.max_upload_bytes + 1
    try:
        return await parser.parse()
    except MultiPartException as e:
        # the parser's limits ("Too many fields ...") are said as they are; its other errors are
        # of a form that is malformed, said by python-multipart's error under Starlette's
        # "Invalid multipart data." where there is one
        what = "over this server's limits" if "max" in e.message.lower() else "malformed"
        detail = str(e.__cause__) if what == "malformed" and e.__cause__ else e.message
        message = f"the multipart form is {what} ({_one_line(detail)})"
        log.info("an upload was refused (400): %s", message)
        raise Refused(400, "form", message) from e


def escape_controls(text: str) -> str:
    """``text`` with its control characters written as escapes (``\\x1b``, ``\\n``): what a
    client sent, made safe for one line of a log or a message."""
    return re.sub(r"[\x00-\x1f\x7f-\x9f]", lambda m: m[0].encode("unicode_escape").decode(), text)


def _one_line(text: str, limit: int = DETAIL_CHARS) -> str:
    """``text`` (a parser's words about what a client sent) as part of one line: its control
    characters as escapes, cut to ``limit`` characters."""
    text = escape_controls(text.strip())
    return text if len(text) <= limit else text[:limit - 3] + "..."


async def _body(request: Request, limits: Limits) -> AsyncIterator[bytes]:
    """The pieces of a request's body as they come. 408 (and the connection closed) when the whole
    has not come within ``upload_timeout``, or when after ``grace_seconds`` it has come at less than
    ``min_upload_kb_s`` on average; 400 and one log line when the client leaves before the end."""
    start, seen = time.monotonic(), 0
    pieces = request.stream().__aiter__()
    while True:
        # the moment the body's mean rate would fall below the minimum, or its time run out
        due = start + min(limits.upload_timeout,
                          max(limits.grace_seconds, seen / limits.min_upload_bytes_per_s))
        try:
            piece = await asyncio.wait_for(anext(pieces), max(due - time.monotonic(), 0))
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            raise Refused(408, "slow_upload", f"the upload came too slowly ({seen} bytes in "
                          f"{time.monotonic() - start:.1f} s): this server takes a body within "
                          f"{limits.upload_timeout:g} s, at {limits.min_upload_kb_s:g} KB/s or "
                          f"more after the first {limits.grace_seconds:g} s",
                          {"Connection": "close"}) from None
        except ClientDisconnect:
            log.info("an upload ended early: its client left after %d bytes", seen)
            raise Refused(400, "disconnect", "the client left before its upload was in") from None
        seen += len(piece)
        yield piece


def _drain_limit(limit: int) -> int:
    """The most of an oversize body read (and dropped) before answering 413."""
    return max(4 * limit, 8 * 2 ** 20)
