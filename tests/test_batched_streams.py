"""Batched streams: the chunk forwards of concurrent streams run together, one batched forward
(``ConformerEncoder.forward_chunks``), and each stream gets what its own ``forward_chunk`` gives it.
Counted, never timed."""
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
    forward_chunks); each tick batches the windows of one length (the last windows are shorter)."""
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
                # encoded alone: the state forward_chunk gives goes on into forward_chunks
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
                out, states = encoder.forward_chunks(feats, [batched[b] for b in rows], left_frames)
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
        encoder.forward_chunks(torch.randn(2, 15, 80), [None])
    full = ConformerEncoder(model_config_from_preset("tiny", vocab_size=V)).eval()
    with pytest.raises(ValueError, match="causal_conv"):
        full.forward_chunks(torch.randn(1, 15, 80), [None])
