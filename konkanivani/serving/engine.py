"""The recognizer a server holds, loaded once and only read, and how the server decodes with it.

Decoding is CPU-bound, so none of it runs on the event loop, and it runs in two lanes, so that a
live stream never waits behind an upload: streams' calls (``Engine.stream_accept``,
``stream_finish``) go to the stream lane, uploads' (``Engine.run``) to the upload lane, each a pool
of ``workers`` decode threads (one by default). A 600-second upload takes its lane for seconds;
a stream's chunk takes tens of milliseconds, and would wait that long behind it in one queue. The
two lanes share PyTorch's intra-op threads between them (``lane_threads``: uploads half, streams the
rest, as many in all as PyTorch had), so that both lanes busy do not ask for twice the cores. The
event loop stays free to answer ``/health`` and to read the next frames while a chunk decodes.

A streaming checkpoint (trained with ``--causal_conv``) decodes an upload as
``konkanivani-transcribe --chunk_size`` does a file: through a stream, in segments that end at
pauses, with word times. Any other checkpoint decodes it as that tool does a file
(``Recognizer.waveform_results``): up to 30 s whole, longer in windows of at most 20 s cut at quiet
moments (``quiet_windows``), each decoded whole with ``method``, with the same words, times and
probabilities as ``konkanivani-transcribe --format json`` gives; it cannot stream (``/stream`` says
so).

An export folder (``decoding.onnx_recognizer.ExportedRecognizer``, onnxruntime) decodes uploads in
those windows through ``model.onnx`` with ``greedy`` or ``beam`` (no attention decoder: nothing
rescored), their words aligned to the graph's CTC output as a checkpoint's are to its own, and
streams through ``encoder_chunk.onnx`` when it has it, in the chunks it was exported for.

Batched streams (``batch_streams``, a checkpoint's): the chunk forwards of concurrent streams run
together. The server calls a stream's ``accept`` and ``finish`` through ``Engine.stream_accept``
and ``Engine.stream_finish``, which hand them to the ``StreamBatcher``: it takes what is pending
each time the decode thread is free (one call a stream), makes each stream's new audio into
features, and encodes the windows that are ready in one batched forward
(``ModelChunks.encode_together``: the streams at their own offsets, their caches padded), again
while any stream has one more; each stream's CTC prefix beam and endpointing go on alone with its
own chunk (``Stream.chunk_encoded``), so a stream gives what it gives alone. The export's chunk
graph takes one stream: it streams per stream. A batcher whose loop fails (a bug outside a call's
own decoding) fails every call it holds with the reason, logged once, and the next call starts it
again: no client waits on a loop that is gone.
"""
from __future__ import annotations

import asyncio
import dataclasses
import io
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Awaitable, Callable, TypeVar

import soundfile as sf
import torch

from ..data.audio import AudioError, read_blocks
from ..data.frames import SAMPLE_RATE
from ..decoding.onnx_recognizer import ExportedRecognizer
from ..decoding.recognizer import MIN_SAMPLES, Recognizer
from ..decoding.settings import DecodingConfig
from ..decoding.streaming import (
    FRAME_SECONDS,
    ModelChunks,
    Result,
    Stream,
    check_sample_rate,
    quiet_windows,
)

__all__ = ["BatcherStopped", "Engine", "StreamBatcher", "UploadTooLong", "lane_threads"]

log = logging.getLogger("konkanivani")
T = TypeVar("T")
_STOPPED = "stream decoding stopped: "  # how a BatcherStopped's message starts
UPLOAD = "the upload"  # how messages name an uploaded file: never by a name the client chose
# The samples a second of an upload may hold, its channels together (48 kHz stereo), over its
# seconds: a file of more is refused by its header. 590 s of 8 channels at 192 kHz is a 938 KB
# FLAC of silence, and was decoded whole to float32 (3.6 GB) before it was mixed down.
MAX_SOURCE_RATE = 2 * 48_000
# The samples of all channels an upload's block holds as it is decoded (1 MB of float32)
BLOCK_SAMPLES = 2 ** 18


class BatcherStopped(RuntimeError):
    """A stream's call that its ``StreamBatcher`` could not run: it was closed, or its loop failed
    (the message says which, and why)."""


class UploadTooLong(ValueError):
    """An upload holds more audio than the server takes (``Limits.max_upload_seconds``)."""


def lane_threads(total: int) -> tuple[int, int]:
    """The intra-op threads of a stream lane's and an upload lane's decode thread, of ``total``
    (PyTorch's own count): uploads half, streams the rest, each at least one. A stream's chunk is
    small and gains little from more threads; an upload alone is slower on half of them, which is
    the price of streams that keep their pace beside it."""
    uploads = max(1, total // 2)
    return max(1, total - uploads), uploads


def _use_threads(n: int) -> None:
    """A lane thread's initializer: this thread's PyTorch ops use ``n`` threads. PyTorch sets a new
    thread's count from the process's at its first op, so that is done first and then changed,
    for this thread alone (OpenMP's count is a thread's own; the process's default, which threads
    started later take, becomes ``n`` too)."""
    torch.get_num_threads()
    torch.set_num_threads(n)


class Engine:
    """A recognizer (a checkpoint's, or an export folder's) and its ``DecodingConfig``, checked and
    resolved once for it (``ValueError`` in one line): ``decoding`` holds the settings it decodes
    with. ``streaming`` says whether the model can stream; one that cannot decodes whole windows,
    with no chunk (the chunk settings are a stream's). ``batch_streams``: a streaming checkpoint's
    streams are encoded together (see the module; ``batcher``); else each alone, as an export's
    always are."""

    def __init__(self, recognizer: Recognizer | ExportedRecognizer,
                 decoding: DecodingConfig | None = None, workers: int = 1,
                 batch_streams: bool = True):
        self.recognizer = recognizer
        self.exported = isinstance(recognizer, ExportedRecognizer)
        if self.exported:
            self.streaming = recognizer.streaming is not None
        else:
            self.streaming = bool(recognizer.model.cfg.causal_conv)
            for p in recognizer.model.parameters():  # read-only: no request can train or change it
                p.requires_grad_(False)
        decoding = decoding or DecodingConfig()
        if not self.streaming:
            decoding = dataclasses.replace(decoding, chunk_size=0, left_chunks=-1, endpoint_ms=None)
        self.decoding = recognizer.settings(decoding, streams=self.streaming)
        if self.streaming:
            # refuses settings the model cannot take; warns once of untrained chunks
            self.open_stream()
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        stream_threads, upload_threads = lane_threads(torch.get_num_threads())
        # the two lanes (see the module): a stream's chunk never queues behind an upload
        self.stream_lane = ThreadPoolExecutor(workers, thread_name_prefix="konkanivani-stream",
                                              initializer=_use_threads,
                                              initargs=(stream_threads,))
        self.upload_lane = ThreadPoolExecutor(workers, thread_name_prefix="konkanivani-upload",
                                              initializer=_use_threads,
                                              initargs=(upload_threads,))
        # the seconds the decode threads spent working (the /metrics counter of that name)
        self.busy_seconds, self._busy_lock = 0.0, threading.Lock()
        batched = batch_streams and self.streaming and not self.exported
        self.batcher = StreamBatcher(self._on_streams) if batched else None

    @property
    def description(self) -> dict:
        d = self.decoding
        info = {"model_format": "onnx" if self.exported else "checkpoint",
                "streaming": self.streaming, "method": d.method, "beam_size": d.beam_size}
        if self.streaming:
            chunk_ms = round(d.chunk_size * FRAME_SECONDS * 1000)
            info.update(chunk_size=d.chunk_size, chunk_ms=chunk_ms, left_chunks=d.left_chunks,
                        endpoint_ms=d.endpoint_ms, batch_streams=self.batcher is not None)
        return info

    @property
    def notes(self) -> dict:
        """What ``/health`` says of the model beyond ``description``."""
        if not self.exported:
            return {}
        return {"note": "an ONNX export: CTC search only (greedy or beam) over model.onnx"
                        + (" and encoder_chunk.onnx" if self.streaming else "")
                        + "; no attention rescoring, as the decoder is not exported"}

    @property
    def why_not_streaming(self) -> str:
        if self.exported:
            return "the export has no encoder_chunk.onnx: export with --streaming"
        return "trained without --causal_conv"

    async def run(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` on the upload lane: an upload's reading and decoding."""
        return await self._on(self.upload_lane, fn, *args)

    async def stream_accept(self, stream: Stream, samples) -> list[Result]:
        """``stream.accept(samples)``: in the batcher's next tick, its chunks encoded with the other
        streams', when the engine batches streams; else on a decode thread."""
        if self.batcher is not None:
            return await self.batcher.submit(stream, samples)
        return await self._on_streams(stream.accept, samples)

    async def stream_finish(self, stream: Stream) -> list[Result]:
        """``stream.finish()``, as ``stream_accept``."""
        if self.batcher is not None:
            return await self.batcher.submit(stream, None)
        return await self._on_streams(stream.finish)

    async def _on_streams(self, fn: Callable[..., T], *args) -> T:
        return await self._on(self.stream_lane, fn, *args)

    async def _on(self, lane: ThreadPoolExecutor, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(lane, self._timed, fn, *args)

    def _timed(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` on a decode thread, its time added to ``busy_seconds``."""
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            with self._busy_lock:
                self.busy_seconds += time.perf_counter() - start

    def close(self) -> None:
        if self.batcher is not None:
            self.batcher.close()
        for lane in (self.stream_lane, self.upload_lane):
            lane.shutdown(wait=False, cancel_futures=True)

    def open_stream(self, sample_rate: int = SAMPLE_RATE) -> Stream:
        """A client's stream, fed through ``stream_accept`` and ``stream_finish``."""
        return self.recognizer.stream(self.decoding, sample_rate=sample_rate)

    @staticmethod
    def read_upload(data: bytes, max_seconds: float) -> torch.Tensor:
        """The 16 kHz mono waveform of an uploaded file's bytes, read in memory block by block
        (``read_blocks``: each block mixed down and resampled as it is decoded, never the whole file
        at its own rate and channels). ``AudioError`` when it cannot be read or is too short for the
        model; ``UploadTooLong`` beyond ``max_seconds`` or ``MAX_SOURCE_RATE`` samples a second of
        them by its header, before decoding it, and beyond ``max_seconds`` as decoded."""
        try:
            info = sf.info(io.BytesIO(data))
        # soundfile raises LibsndfileError, RuntimeError, TypeError...
        except Exception as e:  # noqa: BLE001
            raise AudioError(
                "audio unreadable", UPLOAD, str(getattr(e, "error_string", e)).strip() or None
            ) from e
        try:
            check_sample_rate(info.samplerate)
        except ValueError as e:
            raise AudioError("sample rate unsupported", UPLOAD, str(e)) from e
        seconds = info.frames / info.samplerate
        if seconds > max_seconds:
            raise UploadTooLong(
                f"{seconds:.1f} s of audio: the server takes at most {max_seconds:g} s in one "
                "upload"
            )
        if info.frames * info.channels > max_seconds * MAX_SOURCE_RATE:
            raise UploadTooLong(
                f"{seconds:.1f} s of {info.channels} channels at {info.samplerate} Hz: the server "
                f"decodes at most {max_seconds:g} s of 48 kHz stereo "
                f"({max_seconds * MAX_SOURCE_RATE / 1e6:g} M samples) in one upload"
            )
        blocks, decoded = [], 0
        block_seconds = max(BLOCK_SAMPLES // info.channels, 1) / info.samplerate
        for block in read_blocks(io.BytesIO(data), block_seconds, label=UPLOAD):
            blocks.append(block)
            decoded += len(block)
            if decoded > max_seconds * SAMPLE_RATE:  # a header can promise less than it holds
                raise UploadTooLong(
                    f"more than {max_seconds:g} s of audio: the server takes at most "
                    f"{max_seconds:g} s in one upload"
                )
        wav = torch.cat(blocks) if blocks else torch.zeros(0)
        if len(wav) < MIN_SAMPLES:
            raise AudioError(
                "audio too short",
                UPLOAD,
                f"{len(wav) / SAMPLE_RATE:.3f} s; the model needs at "
                f"least {MIN_SAMPLES / SAMPLE_RATE:.3f} s",
            )
        return wav

    def transcribe(self, wav: torch.Tensor, hotwords: tuple[str, ...] = ()) -> list[Result]:
        """The final results of a 16 kHz waveform (see the module): segments in order, the empty one
        only when no segment has text. ``hotwords``: a request's checked lines, for a checkpoint
        whose method takes them, decoded besides the engine's own."""
        d = self.decoding
        if hotwords:
            d = dataclasses.replace(d, hotwords=(*d.hotwords, *hotwords))
        if not self.exported:
            if not self.streaming:  # as konkanivani-transcribe gives it, words and all
                return self.recognizer.waveform_results(wav, d)
            stream = self.recognizer.stream(d)
            return [r for r in stream.accept(wav) + stream.finish() if r.is_final]
        results = []
        for first, window in quiet_windows([wav]):
            # a last sliver of a window: too short to decode alone (the front-end's least)
            if len(window) < self.recognizer.frontend.min_samples:
                continue
            [r] = self.recognizer.decode_results([window], d, offset=first / SAMPLE_RATE)
            if r.text:
                results.append(Result(r.text, True, round(first / SAMPLE_RATE, 3),
                                      round((first + len(window)) / SAMPLE_RATE, 3), r.words))
        return results or [Result("", True, 0.0, round(len(wav) / SAMPLE_RATE, 3))]


def _settle(future: asyncio.Future, outcome) -> None:
    """``future``'s result, or exception, unless it has one (given already, or its client went
    away)."""
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


@dataclass
class _Call:
    """One stream's ``accept(samples)`` (``finish()`` where ``samples`` is None) in a tick."""

    stream: Stream
    samples: object
    future: asyncio.Future


class StreamBatcher:
    """Runs the calls of concurrent streams in ticks, their chunk forwards batched (see the module).
    ``run`` runs a function on a decode thread (the engine's stream lane). Each tick takes the calls
    pending when the decode thread is free, one a stream (a stream's next call waits for the next
    tick); a stream whose call fails fails alone (its exception is its call's), the others go on.
    Should the loop of ticks itself fail, or be closed, every call it holds fails with the reason
    (``BatcherStopped``) instead of waiting on a loop that is gone; the next call starts a new one.
    ``forwards`` and ``chunks`` count the encoder forwards run and the chunks they encoded."""

    def __init__(self, run: Callable[..., Awaitable]):
        self.run = run
        self.pending: list[_Call] = []
        self.forwards = self.chunks = self.ticks = 0
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def submit(self, stream: Stream, samples) -> list[Result]:
        """The results of ``stream.accept(samples)`` (``stream.finish()`` when ``samples`` is
        None), computed in the next tick."""
        loop = asyncio.get_running_loop()
        call = _Call(stream, samples, loop.create_future())
        self.pending.append(call)
        if self._task is None or self._task.done() or self._loop is not loop:
            self._loop, self._wake = loop, asyncio.Event()
            self._task = loop.create_task(self._ticks())
        self._wake.set()
        return await call.future

    def close(self) -> None:
        if self._task is not None and not self._task.done() and self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop, self._task)

    def _stop(self, task: asyncio.Task) -> None:
        """Cancel the loop of ticks; the calls it has not taken yet fail here (a loop cancelled
        before it ever ran fails none), those of its tick where it ends."""
        task.cancel()
        self._fail(BatcherStopped(_STOPPED + "the server is closing"))

    def _fail(self, stopped: BatcherStopped, calls: tuple[_Call, ...] = ()) -> None:
        for call in (*calls, *self.pending):
            _settle(call.future, stopped)
        self.pending = []

    async def _ticks(self) -> None:
        calls: list[_Call] = []
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                # the frames the event loop has read already join this tick
                await asyncio.sleep(0)
                calls = self._take()
                if calls:
                    await self._run_tick(calls)
                calls = []
        except BaseException as e:  # noqa: BLE001  closed (cancelled), or a fault of the loop's own
            closed = isinstance(e, asyncio.CancelledError)
            self._fail(BatcherStopped(_STOPPED + ("the server is closing" if closed
                                                  else f"{type(e).__name__}: {e}")), tuple(calls))
            if closed:
                raise
            log.error("the stream batcher failed; its calls were failed with the reason",
                      exc_info=e)

    def _take(self) -> list[_Call]:
        """The calls of the next tick: each stream's first pending call whose client still waits
        (a call whose client went away, its future cancelled, is dropped); the others stay pending,
        for the tick after."""
        calls, later, streams = [], [], set()
        for call in (c for c in self.pending if not c.future.done()):
            (later if id(call.stream) in streams else calls).append(call)
            streams.add(id(call.stream))
        self.pending = later
        if later:
            self._wake.set()
        return calls

    async def _run_tick(self, calls: list[_Call]) -> None:
        loop = asyncio.get_running_loop()

        def deliver(i: int, outcome) -> None:
            # on the decode thread: the call's results go out now, not at the tick's end
            loop.call_soon_threadsafe(_settle, calls[i].future, outcome)

        try:
            outcomes = await self.run(self.tick, [(c.stream, c.samples) for c in calls], deliver)
        except Exception as e:  # noqa: BLE001  the lane is gone (shutdown): every call fails
            outcomes = [e] * len(calls)
        for call, outcome in zip(calls, outcomes):
            _settle(call.future, outcome)

    @torch.inference_mode()
    def tick(self, calls: list[tuple[Stream, object]],
             deliver: Callable[[int, object], None] | None = None
             ) -> list[list[Result] | Exception]:
        """One tick on a decode thread: each call's results, or the exception it raised. ``calls``:
        ``(stream, samples)``, one a stream; samples None: ``finish``. ``deliver(i, outcome)`` is
        called as soon as call ``i``'s outcome is complete (its last window encoded, and for a
        finish its last results), so a stream whose chunk is done need not wait for the others'."""
        self.ticks += 1
        outcomes: list[list[Result] | Exception] = [[] for _ in calls]
        settled = [False] * len(calls)

        def settle_if_done(i: int) -> bool:
            """Deliver call ``i`` if nothing is left of it in this tick; whether it was."""
            stream, samples = calls[i]
            if not isinstance(outcomes[i], Exception):
                if stream.next_window() is not None:
                    return False
                if samples is None:
                    try:
                        outcomes[i] += stream.last_results()
                    except Exception as e:  # noqa: BLE001
                        outcomes[i] = e
            settled[i] = True
            if deliver is not None:
                deliver(i, outcomes[i])
            return True

        for i, (stream, samples) in enumerate(calls):
            try:
                stream.take_end() if samples is None else stream.take(samples)
            # what one stream's audio makes it raise fails its call alone
            except Exception as e:  # noqa: BLE001
                outcomes[i] = e
        live = [i for i in range(len(calls)) if not settle_if_done(i)]
        while live:
            ready = [(i, calls[i][0].next_window()) for i in live]
            self._encode(calls, ready, outcomes, settle_if_done)
            live = [i for i in live if not settled[i]]
        return outcomes

    def _encode(self, calls: list[tuple[Stream, object]], ready: list[tuple[int, torch.Tensor]],
                outcomes: list, settle_if_done: Callable[[int], bool]) -> None:
        """Encode the ``ready`` windows, those of one ``batch_key`` in one forward, and give each
        stream its chunk; then ``settle_if_done`` of that stream."""
        groups: dict[tuple, list[tuple[int, torch.Tensor]]] = {}
        for i, window in ready:
            chunks = calls[i][0].chunks
            key = chunks.batch_key(window) if isinstance(chunks, ModelChunks) else (id(chunks),)
            groups.setdefault(key, []).append((i, window))
        for rows in groups.values():
            streams = [calls[i][0] for i, _ in rows]
            try:
                if len(rows) == 1:
                    encoded = [streams[0].chunks.encode(rows[0][1])]
                else:
                    encoded = ModelChunks.encode_together(
                        [s.chunks for s in streams], [w for _, w in rows]
                    )
                self.forwards, self.chunks = self.forwards + 1, self.chunks + len(rows)
            except Exception:  # noqa: BLE001  each alone, so that only a failing stream fails
                encoded = []
                for stream, (i, window) in zip(streams, rows):
                    try:
                        encoded.append(stream.chunks.encode(window))
                        self.forwards, self.chunks = self.forwards + 1, self.chunks + 1
                    except Exception as e:  # noqa: BLE001
                        encoded.append(e)
            for stream, (i, _), chunk in zip(streams, rows, encoded):
                if isinstance(chunk, Exception):
                    outcomes[i] = chunk
                else:
                    try:
                        outcomes[i] += stream.chunk_encoded(*chunk)
                    except Exception as e:  # noqa: BLE001
                        outcomes[i] = e
                settle_if_done(i)
