"""What one client may ask of the server, and the answer beyond it. The defaults suit one person
trying a model on a laptop; ``konkanivani-serve`` has a flag for each, with the help its field
carries, and docs/serving.md's table of them is generated from the same (docs/generate_flags.py)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["Limits"]


def _limit(default: float, help: str) -> Any:
    """A limit's field: its default, and its help, which ``konkanivani-serve --help`` and the table
    of docs/serving.md (docs/generate_flags.py) both show."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class Limits:
    """Each field is a ``konkanivani-serve`` flag of the same name, with this help."""

    max_upload_mb: float = _limit(25.0, "the largest body POST /transcribe reads, in MB: 413 "
                                  "beyond, the body read no further")
    max_upload_seconds: float = _limit(600.0, "the most audio one upload may hold, in seconds, by "
                                       "its header before it is decoded and as decoded: 413 beyond")
    max_uploads: int = _limit(2, "uploads decoding at once, each counted once its body is in: 503 "
                              "with Retry-After beyond")
    max_streams: int = _limit(8, "WebSocket streams open at once: 503 with Retry-After beyond (the "
                              "handshake)")
    max_client_uploads: int = _limit(2, "uploads one client address may have at once, read or "
                                     "decoded: 429 with Retry-After beyond")
    max_client_streams: int = _limit(4, "streams one client address may have open at once: 429 "
                                     "with Retry-After beyond (the handshake)")
    upload_timeout: float = _limit(300.0, "seconds an upload's whole body may take to arrive: 408 "
                                   "beyond, the connection closed")
    min_upload_kb_s: float = _limit(16.0, "the least mean rate of an upload's body after "
                                    "--grace_seconds, in KB/s: 408 below, the connection closed")
    min_stream_rate: float = _limit(0.5, "the least audio a stream sends over its time after "
                                    "--grace_seconds, as a fraction of real time (at most 1): "
                                    "below, its last results, done and close 1008")
    grace_seconds: float = _limit(10.0, "an upload's or a stream's first seconds, before its rate "
                                  "is held")
    max_stream_seconds: float = _limit(600.0, "the most audio one stream may send, in seconds: "
                                       "then its last results, done and close 1008")
    idle_seconds: float = _limit(30.0, "a stream that sends nothing this long gets its last "
                                 "results, done and close 1008")
    max_frame_kb: float = _limit(256.0, "the largest WebSocket message, in KB (256: 1.3 s of 48 "
                                 "kHz float32): close 1009 beyond")
    retry_after_s: int = _limit(5, "the Retry-After of a 503 or a 429, in seconds")
    header_timeout: float = _limit(10.0, "seconds a request's head (its request line and headers) "
                                   "may take to arrive, on a new connection or a kept-alive one: "
                                   "beyond, the connection closed")
    max_connections: int = _limit(2000, "connections open at once, streams included: one beyond "
                                  "is answered 503 at once and closed")

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if not value > 0:
                raise ValueError(f"{f.name} must be positive, got {value}")
        # a live microphone sends audio at real time: a minimum above it would close every stream
        if self.min_stream_rate > 1:
            raise ValueError(f"min_stream_rate must be at most 1 (real time), got "
                             f"{self.min_stream_rate}")

    @property
    def max_upload_bytes(self) -> int:
        return int(self.max_upload_mb * 2 ** 20)

    @property
    def max_frame_bytes(self) -> int:
        return int(self.max_frame_kb * 2 ** 10)

    @property
    def min_upload_bytes_per_s(self) -> float:
        return self.min_upload_kb_s * 2 ** 10
