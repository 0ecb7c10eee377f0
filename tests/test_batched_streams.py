"""Batched streams: the chunk forwards of concurrent streams run together, one batched forward
(``ConformerEncoder.forward_chunk_of_streams``), and each stream gets what its own
``forward_chunk`` gives it. Counted, never timed."""
import functools

import pytest
import torch

from konkanivani.config import model_config_from_preset
from konkanivani.model.conformer import ConformerEncoder, feature_windows

V = 40


@functools.lru_cache(maxsize=None)
def _encoder(subsampling: str) -> ConformerEncoder:
    torch.manual_seed(0)
    cfg = model_config_from_preset("tiny", vocab_size=V, subsampling=subsampling, causal_conv=True)
    return ConformerEncoder(cfg).eval()


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool((a - b).abs().max() <= 1e-5) if a.numel() else True


@pytest.mark.parametrize("subsampling", ["conv2d", "dw_striding"])
@pytest.mark.parametrize("chunk, left", [(4, -1), (4, 2), (3, 1), (2, 0)])
def test_a_batched_forward_gives_each_stream_what_its_own_forward_chunk_gives(
    subsampling, chunk, left
):
    """Five streams of different lengths join at different ticks (so they stand at different
    offsets with caches of different lengths, some cut to left_frames, some at their first chunk),
    the first two encoded alone for their first chunks (forward_chunk's states into
    forward_chunk_of_streams); each tick batches the windows of one length (the last windows are
    shorter)."""
    encoder = _encoder(subsampling)
    left_frames = left * chunk if left >= 0 else -1
    torch.manual_seed(2)
    windows = [feature_windows(torch.randn(1, n, 80), chunk) for n in (211, 150, 97, 180, 33)]
    joins = [0, 1, 3, 4, 6]
    solo: list = [None] * 5
    batched: list = [None] * 5
    batches, rows_seen, first_chunks, mixed_lengths = 0, 0, 0, 0
    with torch.inference_mode():
        for tick in range(80):
            due = [b for b in range(5) if 0 <= tick - joins[b] < len(windows[b])]
            for b in [b for b in due if b < 2 and tick - joins[b] < 2]:
                # encoded alone: the state forward_chunk gives goes on into forward_chunk_of_streams
                window = windows[b][tick - joins[b]]
                _, solo[b] = encoder.forward_chunk(window, solo[b], left_frames)
                batched[b] = solo[b]
            due = [b for b in due if not (b < 2 and tick - joins[b] < 2)]
            for length in sorted({windows[b][tick - joins[b]].shape[1] for b in due}):
                rows = [b for b in due if windows[b][tick - joins[b]].shape[1] == length]
                feats = torch.cat([windows[b][tick - joins[b]] for b in rows])
                cached = {encoder_cached(batched[b]) for b in rows}
                mixed_lengths += len(cached) > 1
                first_chunks += sum(batched[b] is None for b in rows)
                out, states = encoder.forward_chunk_of_streams(
                    feats, [batched[b] for b in rows], left_frames
                )
                batches, rows_seen = batches + 1, rows_seen + len(rows)
                for i, b in enumerate(rows):
                    alone, solo[b] = encoder.forward_chunk(feats[i:i + 1], solo[b], left_frames)
                    assert _close(out[i], alone[0]), (tick, b)
                    state, expected = states[i], solo[b]
                    assert state.offset == expected.offset
                    for n, (k, v) in enumerate(expected.keys_values):
                        assert _close(state.keys_values[n][0], k) and _close(
                            state.keys_values[n][1], v
                        )
                        assert _close(state.conv_inputs[n], expected.conv_inputs[n])
                    batched[b] = state
    assert all(len(windows[b]) + joins[b] <= 80 for b in range(5))  # every stream to its end
    assert [s.offset for s in batched] == [s.offset for s in solo]
    # batches of 2.5 rows on average; caches of different lengths in one batch, but where every
    # cache holds nothing (left 0)
    assert batches >= 15 and rows_seen >= 2 * batches and first_chunks == 3
    assert mixed_lengths >= (0 if left == 0 else 3)
    if left_frames >= 0:
        assert max(encoder_cached(s) for s in batched) <= left_frames


def encoder_cached(state) -> int:
    """The past frames a state's attention caches hold (None: 0)."""
    if state is None:
        return 0
    kv = state.keys_values
    return kv[0][0].shape[2]


def test_a_batched_forward_takes_one_state_a_window_and_a_streaming_model():
    encoder = _encoder("conv2d")
    with pytest.raises(ValueError, match="2 windows and 1 states"):
        encoder.forward_chunk_of_streams(torch.randn(2, 15, 80), [None])
    full = ConformerEncoder(model_config_from_preset("tiny", vocab_size=V)).eval()
    with pytest.raises(ValueError, match="causal_conv"):
        full.forward_chunk_of_streams(torch.randn(1, 15, 80), [None])


# The engine: concurrent streams through its batcher, each with what it gives alone.


@pytest.fixture(scope="module")
def recognizer(tone_model):
    """conftest's tiny streaming model that has learned the four tone sentences (120 steps)."""
    return tone_model


def _clips():
    """Five streams of different audio and lengths (one or two tone sentences, 0.2-1.2 s of silence
    between), sent in pieces of different sizes, one at 48 kHz; each joins once the first stream
    has sent ``join`` pieces."""
    from tone_speech import SENTENCES, speech

    clips = []
    for i, (gap, piece, join, rate) in enumerate(
        [(19200, 1600, 0, 16000), (3200, 2400, 1, 16000), (0, 800, 1, 16000),
         (12800, 4000, 4, 16000), (8000, 3 * 1600, 7, 48000)]
    ):
        wav = speech(SENTENCES[i % 4], seed=20 + i)
        if gap:
            wav = torch.cat([wav, torch.zeros(gap), speech(SENTENCES[(i + 1) % 4], seed=30 + i)])
        if rate != 16000:  # the same sound at 48 kHz: the stream resamples it
            wav = torch.nn.functional.interpolate(wav[None, None], scale_factor=3,
                                                  mode="linear")[0, 0]
        clips.append((list(wav.split(piece)), join, rate))
    return clips


async def _feed(engine, clips, bad_stream=None):
    """Every clip through its own stream of ``engine`` at once, as the server's sessions call it
    (``Engine.stream_accept(stream, piece)``, then ``stream_finish``): each stream's results (or
    the exception its call raised); ``bad_stream``'s third piece is not mono audio."""
    import asyncio

    sent = [asyncio.Event() for _ in range(max(len(p) for p, _, _ in clips) + 1)]
    sent[0].set()

    async def client(i, pieces, join, rate):
        await sent[join].wait()
        stream, results = engine.open_stream(rate), []
        try:
            for n, piece in enumerate(pieces):
                if i == bad_stream and n == 2:
                    piece = piece[None]  # (1, N): refused in one line, the stream fails alone
                results += await engine.stream_accept(stream, piece)
                if i == 0:
                    sent[n + 1].set()
            results += await engine.stream_finish(stream)
        except ValueError as e:
            return e
        finally:
            if i == 0:
                for event in sent:
                    event.set()
        return results

    return await asyncio.gather(*(client(i, *clip) for i, clip in enumerate(clips)))


def _alone(recognizer, engine, clips):
    return [
        list(recognizer.stream_results(pieces, engine.decoding, sample_rate=rate))
        for pieces, _, rate in clips
    ]


@pytest.mark.parametrize("method, left_chunks", [("rescore", -1), ("beam", 1)])
def test_concurrent_streams_through_the_batching_engine_give_what_each_gives_alone(
    recognizer, method, left_chunks
):
    import asyncio

    from konkanivani.decoding.settings import DecodingConfig
    from konkanivani.serving.engine import Engine

    decoding = DecodingConfig(method=method, chunk_size=4, left_chunks=left_chunks, beam_size=4,
                              endpoint_ms=400)
    engine = Engine(recognizer, decoding)
    clips = _clips()
    try:
        # a streaming checkpoint's engine batches its streams by default
        assert engine.batcher is not None and engine.description["batch_streams"]
        together = asyncio.run(_feed(engine, clips))
    finally:
        engine.close()
    alone = _alone(recognizer, engine, clips)
    for mine, expected in zip(together, alone):
        assert mine == expected  # partials and finals: text, times, words
    finals = [[r.text for r in results if r.is_final] for results in alone]
    assert sum(len(f) == 2 for f in finals) >= 3 and all(any(f) for f in finals)
    assert sum(not r.is_final for results in alone for r in results) >= 40
    batcher = engine.batcher
    # every chunk of every stream went through the batcher, most of them with others'
    assert batcher.chunks == sum(
        len(feature_windows(torch.zeros(1, _frames(recognizer, pieces, rate), 80), 4))
        for pieces, _, rate in clips
    )
    assert batcher.forwards <= 0.6 * batcher.chunks
    # calls ran in ticks: fewer ticks than calls (a tick takes every stream's pending call)
    calls = sum(len(pieces) + 1 for pieces, _, _ in clips)
    assert batcher.ticks <= 0.6 * calls


def _frames(recognizer, pieces, rate):
    """The feature frames of a stream of ``pieces`` at ``rate``, as it computes them."""
    stream = recognizer.stream(chunk_size=4, sample_rate=rate)
    for piece in pieces:
        stream.features.accept(stream.resampler(piece))
    return stream.features.frames + len(stream.features.finish())


def test_a_stream_that_fails_fails_alone_and_the_per_stream_path_stays(recognizer):
    import asyncio

    from konkanivani.decoding.settings import DecodingConfig
    from konkanivani.decoding.streaming import Stream
    from konkanivani.serving.engine import Engine

    decoding = DecodingConfig(method="beam", chunk_size=4, beam_size=4)
    clips = _clips()
    engine = Engine(recognizer, decoding)
    try:
        together = asyncio.run(_feed(engine, clips, bad_stream=1))
    finally:
        engine.close()
    alone = _alone(recognizer, engine, clips)
    assert isinstance(together[1], ValueError) and "mono samples" in str(together[1])
    assert [r for i, r in enumerate(together) if i != 1] == [
        r for i, r in enumerate(alone) if i != 1
    ]

    solo = Engine(recognizer, decoding, batch_streams=False)
    try:
        assert solo.batcher is None and isinstance(solo.open_stream(), Stream)
        assert solo.description["batch_streams"] is False
        assert asyncio.run(_feed(solo, clips)) == alone
    finally:
        solo.close()


def test_a_streams_results_go_out_once_its_own_chunks_are_done(recognizer):
    """Within a tick, a stream whose windows are all encoded is delivered then, not after the
    others' chunks: the short stream's results leave while the long one still has windows."""
    from tone_speech import SENTENCES, speech

    from konkanivani.decoding.settings import DecodingConfig
    from konkanivani.serving.engine import Engine

    engine = Engine(recognizer, DecodingConfig(method="beam", chunk_size=4, beam_size=4))
    try:
        short, long = engine.open_stream(), engine.open_stream()
        encoded = {id(short): 0, id(long): 0}
        for stream in (short, long):
            def counted(*chunk, stream=stream, inner=stream.chunk_encoded):
                encoded[id(stream)] += 1
                return inner(*chunk)
            stream.chunk_encoded = counted
        delivered = {}

        def deliver(i, outcome):
            delivered[i] = (dict(encoded), outcome)

        wav = torch.cat([speech(s, seed=i) for i, s in enumerate(SENTENCES)])
        outcomes = engine.batcher.tick([(short, wav[:8000]), (long, wav)], deliver)
    finally:
        engine.close()
    assert set(delivered) == {0, 1} and [delivered[i][1] for i in (0, 1)] == outcomes
    at_short = delivered[0][0]
    assert at_short[id(short)] >= 1 and at_short[id(long)] < encoded[id(long)]
    assert delivered[1][0] == encoded  # the long one when all was done


# Lanes: a stream never waits behind an upload; a batcher that fails fails its calls with why.


@pytest.mark.parametrize("batch_streams", [True, False])
def test_a_stream_gets_its_results_while_an_upload_holds_the_upload_lane(recognizer,
                                                                          batch_streams):
    """An upload in flight (its lane held on an event, as a 600-second upload holds it: no timing)
    holds back no live stream: every chunk of the stream gives its partial results, the results it
    gives alone, while the upload still waits; the upload then decodes on its own lane, with half
    of PyTorch's threads."""
    import asyncio
    import threading

    from tone_speech import SENTENCES, speech

    from konkanivani.decoding.settings import DecodingConfig
    from konkanivani.serving.engine import Engine, lane_threads

    engine = Engine(recognizer, DecodingConfig(method="beam", chunk_size=4, beam_size=4),
                    batch_streams=batch_streams)
    total = torch.get_num_threads()
    gate, started, seen = threading.Event(), threading.Event(), {}
    wav = torch.cat([speech(SENTENCES[0], seed=3), torch.zeros(16000),
                     speech(SENTENCES[1], seed=4)])
    pieces = list(wav.split(1600))

    def long_upload(upload):
        seen.update(thread=threading.current_thread().name, threads=torch.get_num_threads())
        started.set()
        if not gate.wait(60):
            raise TimeoutError("the test never let the upload go")
        return engine.transcribe(upload)

    async def scenario():
        upload = asyncio.ensure_future(engine.run(long_upload, wav))
        assert await asyncio.to_thread(started.wait, 30)
        stream, results = engine.open_stream(), []
        try:
            for piece in pieces:
                results += await asyncio.wait_for(engine.stream_accept(stream, piece), 30)
            results += await asyncio.wait_for(engine.stream_finish(stream), 30)
            assert not upload.done()  # every result came while the upload held its lane
        finally:
            gate.set()
        return results, await asyncio.wait_for(upload, 60)

    try:
        streamed, uploaded = asyncio.run(scenario())
    finally:
        engine.close()
    assert streamed == list(recognizer.stream_results(pieces, engine.decoding))
    assert sum(not r.is_final for r in streamed) >= 5 and any(r.is_final for r in streamed)
    assert uploaded == [r for r in streamed if r.is_final]
    assert seen == {"thread": seen["thread"], "threads": lane_threads(total)[1]}
    assert seen["thread"].startswith("konkanivani-upload")
    assert lane_threads(1) == (1, 1) and lane_threads(2) == (1, 1) and lane_threads(8) == (4, 4)


def test_a_batcher_that_fails_fails_its_calls_with_the_reason_and_starts_again(recognizer,
                                                                                caplog):
    """A fault in the loop of ticks itself (outside any stream's decoding) fails every call it
    holds with the reason, within a bound, and is logged; the next call is decoded by a new loop.
    Closed with a call waiting, that call fails saying so."""
    import asyncio
    import threading

    from tone_speech import SENTENCES, speech

    from konkanivani.decoding.settings import DecodingConfig
    from konkanivani.serving.engine import BatcherStopped, Engine

    decoding = DecodingConfig(method="beam", chunk_size=4, beam_size=4)
    engine = Engine(recognizer, decoding)
    batcher, piece = engine.batcher, speech(SENTENCES[2], seed=5)[:8000]
    take = batcher._take

    def broken():
        batcher._take = take  # once
        raise RuntimeError("the tick's bookkeeping broke")

    batcher._take = broken
    gate = threading.Event()

    async def scenario():
        calls = [engine.stream_accept(engine.open_stream(), piece) for _ in range(2)]
        failed = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 30)
        after = await asyncio.wait_for(engine.stream_accept(engine.open_stream(), piece), 30)
        # the stream lane held, a call waits in the batcher when the engine closes
        held = asyncio.ensure_future(engine._on_streams(gate.wait, 30))
        waiting = asyncio.ensure_future(engine.stream_accept(engine.open_stream(), piece))
        for _ in range(100):  # until its tick has taken it (and waits on the lane)
            if not batcher.pending:
                break
            await asyncio.sleep(0)
        engine.close()
        try:
            closing = await asyncio.wait_for(asyncio.gather(waiting, return_exceptions=True), 30)
        finally:
            gate.set()
        held.cancel()
        return failed, after, closing

    try:
        failed, after, closing = asyncio.run(scenario())
    finally:
        gate.set()
        engine.close()
    assert all(isinstance(e, BatcherStopped) for e in failed), failed
    assert {str(e) for e in failed} == {
        "stream decoding stopped: RuntimeError: the tick's bookkeeping broke"}
    assert "the stream batcher failed" in caplog.text
    assert after == recognizer.stream(decoding).accept(piece)
    [closed] = closing
    assert isinstance(closed, BatcherStopped) and "closing" in str(closed)
