"""What one client may ask of the server, and the answer beyond it. The defaults suit one person
trying a model on a laptop; ``konkanivani-serve`` has a flag for each (docs/serving.md)."""
from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["Limits"]


@dataclass(frozen=True)
class Limits:
    max_upload_mb: float = 25.0  # the body of POST /transcribe; 413 beyond (read no further)
    max_upload_seconds: float = 600.0  # the audio of one upload, by its header and as decoded; 413 beyond
    max_uploads: int = 2  # uploads decoding at once (once the body is in); 503 + Retry-After beyond
    max_streams: int = 8  # WebSocket streams open at once; 503 with Retry-After beyond
    max_client_uploads: int = 2  # uploads one address has at once (read, decoded); 429 beyond
    max_client_streams: int = 4  # streams one client address has open at once; 429 beyond
    upload_timeout: float = 300.0  # the whole body of an upload must arrive within this; 408 beyond
    min_upload_kb_s: float = 16.0  # a body's least mean rate after grace_seconds; 408 below
    min_stream_rate: float = 0.5  # a stream's least audio over its time after the grace; close 1008
    grace_seconds: float = 10.0  # an upload's or a stream's first seconds, before its rate is held
    max_stream_seconds: float = 600.0  # the audio of one stream; then its last results and close 1008
    idle_seconds: float = 30.0  # a stream without a frame this long: its last results and close 1008
    max_frame_kb: float = 256.0  # one WebSocket message (1.3 s of 48 kHz float32); close 1009 beyond
    retry_after_s: int = 5  # the Retry-After of a 503 or a 429

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
