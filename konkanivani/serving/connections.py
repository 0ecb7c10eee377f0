"""What uvicorn leaves open about connections: a deadline for a request's head, a cap on the
connections open at once, and a log that says a refusal once per interval rather than once per
socket.

uvicorn's h11 protocol has no deadline for a request's head: its keep-alive timeout starts after a
response, and any byte received cancels it, so a client that sends a header line now and then holds
its socket (a file descriptor) for ever. Its ``limit_concurrency`` answers 503 only once a request's
head has come in, which such a client never sends, so it bounds no sockets either. ``protocol``
makes uvicorn's own protocol class that does both, for ``uvicorn.Config(http=...)``.
"""
from __future__ import annotations

import asyncio
import logging
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["LOG_EVERY_S", "OncePerInterval", "protocol"]

LOG_EVERY_S = 60.0
log = logging.getLogger("konkanivani.connections")
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
         b"retry-after: %d\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%b")


def protocol(header_timeout: float, max_connections: int, retry_after_s: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol, with each request's head (the first, and each after a keep-alive
    response) due within ``header_timeout`` seconds of the socket waiting for it, else the
    connection closed; and a connection beyond ``max_connections`` open answered 503 at once and
    closed, its file descriptor given back before it is read from. Both logged once per interval
    (``OncePerInterval`` on this module's logger)."""
    busy = b"too many connections open; try again\n"
    busy = _BUSY % (retry_after_s, len(busy), busy)

    class Protocol(H11Protocol):
        deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                log.warning("connections refused (503): %d open, the most --max_connections "
                            "takes", max_connections)
                transport.write(busy)
                transport.close()
                return
            self._await_head()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._await_head()  # the next request's, on a kept-alive connection

        def connection_lost(self, exc: Exception | None) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
            super().connection_lost(exc)

        def _await_head(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
            self.deadline = self.loop.call_later(header_timeout, self._head_due)

        def _head_due(self) -> None:
            # IDLE: h11 has no whole request head yet (once it has, the request is the app's)
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                log.warning("connections closed whose request head did not come within %g s "
                            "(--header_timeout)", header_timeout)
                self.transport.close()

    return Protocol


class OncePerInterval(logging.Filter):
    """Lets one record of each message (its template, not its filled-in fields) through every
    ``seconds``, dropping the repeats meanwhile; the next one through says how many were dropped.
    A refusal that comes once per socket (an accept that fails for want of file descriptors, a
    connection over the cap) is then a line a minute, not a log that fills the disk."""

    def __init__(self, seconds: float = LOG_EVERY_S):
        super().__init__()
        self.seconds = seconds
        self.last: dict[tuple[str, object], float] = {}
        self.dropped: dict[tuple[str, object], int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key, now = (record.name, record.msg), time.monotonic()
        if key in self.last and now - self.last[key] < self.seconds:
            self.dropped[key] = self.dropped.get(key, 0) + 1
            return False
        self.last[key] = now
        dropped = self.dropped.pop(key, 0)
        if dropped:
            record.msg = f"{record.msg} ({dropped} more like it in the last {self.seconds:g} s)"
        return True
