"""Streaming: one model for full-context and chunk-by-chunk recognition. The chunk mask, the causal
convolution, the per-batch chunk draw of --dynamic_chunk, and the central property: encoding a
stream
chunk by chunk with caches gives the frames the full forward gives under the same chunk mask."""
import doctest
import functools

import pytest
import torch

from konkanivani.config import ModelConfig, model_config_from_preset
from konkanivani.data.frames import subsampled_lengths
from konkanivani.model import conformer
from konkanivani.model.asr import ASRModel, SpecAugment
from konkanivani.model.conformer import ConformerEncoder, feature_windows
from konkanivani.training.objective import Objective

V = 40


def _model(**kw):
    torch.manual_seed(0)
    return ASRModel(model_config_from_preset("tiny", vocab_size=V, **kw))


def test_the_doctests_hold():
    assert doctest.testmod(conformer).failed == 0  # feature_windows; the masks' in test_masks.py


@pytest.mark.parametrize("frames", [7, 8, 10, 11, 30, 50, 217])
@pytest.mark.parametrize("chunk", [1, 3, 4, 25])
def test_feature_windows_make_the_encoder_frames_of_the_whole(frames, chunk):
    made = [
        int(subsampled_lengths(w.shape[1]))
        for w in feature_windows(torch.zeros(1, frames, 2), chunk)
    ]
    assert sum(made) == subsampled_lengths(frames)
    assert all(n == chunk for n in made[:-1]) and 1 <= made[-1] <= chunk


@functools.lru_cache(maxsize=None)
def _causal_encoder(subsampling):
    torch.manual_seed(0)
    return ConformerEncoder(model_config_from_preset("tiny", vocab_size=V, subsampling=subsampling,
                                                     causal_conv=True)).eval()


@pytest.mark.parametrize("subsampling", ["conv2d", "dw_striding"])
@pytest.mark.parametrize("chunk", [1, 2, 4, 8])
@pytest.mark.parametrize("left", [-1, 1, 2])
def test_chunk_by_chunk_with_caches_equals_the_full_forward_under_the_chunk_mask(
    subsampling, chunk, left
):
    encoder = _causal_encoder(subsampling)
    torch.manual_seed(1)
    lens = torch.tensor([217, 150])  # 53 and 36 encoder frames: no multiple of 2, 4 or 8
    feats = torch.randn(2, 217, 80)
    feats[1, 150:] = 0.0
    with torch.no_grad():
        full, full_lens = encoder(feats, lens, chunk_size=chunk, left_chunks=left)
        assert torch.isfinite(full).all()  # padding frames too: no row of the mask is empty
        for b in range(2):
            streamed = encoder.forward_chunk_by_chunk(feats[b:b + 1, :lens[b]], chunk, left)
            assert streamed.shape == (1, full_lens[b], 48)
            assert (streamed[0] - full[b, :full_lens[b]]).abs().max() <= 1e-5


def test_the_chunk_mask_changes_the_output_and_a_chunk_longer_than_the_input_does_not():
    encoder = _causal_encoder("conv2d")
    feats, lens = torch.randn(1, 217, 80), torch.tensor([217])
    with torch.no_grad():
        full = encoder(feats, lens)[0]
        assert not torch.allclose(encoder(feats, lens, chunk_size=4)[0], full, atol=1e-3)
        torch.testing.assert_close(encoder(feats, lens, chunk_size=53)[0], full)


def test_the_rotary_positions_are_absolute_when_the_cache_keeps_a_window():
    """With one left chunk the cache holds 2 frames, yet the 20th chunk's frames sit at 38 and
    39."""
    encoder = _causal_encoder("conv2d")
    feats = torch.randn(1, 167, 80)  # 41 encoder frames
    with torch.no_grad():
        windows = feature_windows(feats, 2)
        state = None
        for window in windows[:-1]:
            _, state = encoder.forward_chunk(window, state, left_frames=2)
        assert state.offset == 40 and state.keys_values[0][0].shape[2] == 2
        assert state.conv_inputs[0].shape == (1, 6, 48)  # conv_kernel 7 of the tiny preset
        last, state = encoder.forward_chunk(windows[-1], state, left_frames=2)
        full = encoder(feats, torch.tensor([167]), chunk_size=2, left_chunks=1)[0]
    assert state.offset == 41
    assert (last[0] - full[0, 40:]).abs().max() <= 1e-5


def test_chunk_by_chunk_needs_a_causal_convolution():
    encoder = ConformerEncoder(model_config_from_preset("tiny", vocab_size=V)).eval()
    with pytest.raises(ValueError, match="causal_conv"):
        encoder.forward_chunk(torch.randn(1, 11, 80))


def test_the_causal_convolution_sees_no_later_frame():
    encoder = _causal_encoder("conv2d")
    feats = torch.randn(1, 217, 80)
    later = feats.clone()
    later[:, 118:] += 1.0  # changes encoder frames 28 on (frame t sees features 4t .. 4t + 6)
    with torch.no_grad():
        a = encoder(feats, torch.tensor([217]), chunk_size=1)[0]
        b = encoder(later, torch.tensor([217]), chunk_size=1)[0]
    assert torch.allclose(a[:, :28], b[:, :28], atol=1e-6)
    assert all(not torch.allclose(a[:, t], b[:, t], atol=1e-3) for t in range(28, a.shape[1]))


def test_default_flags_take_no_chunk_path(monkeypatch):
    """A model of default flags builds no chunk mask and draws no chunk size, in training either: it
    computes what it computed before the streaming flags existed."""
    cfg = ModelConfig(
        vocab_size=V, d_model=48, n_heads=2, ffn_dim=96, encoder_layers=2, decoder_layers=1
    )
    assert not (cfg.dynamic_chunk or cfg.dynamic_left_chunks or cfg.causal_conv)
    torch.manual_seed(0)
    model = ASRModel(cfg)
    assert all(
        b.conv_module.depthwise.padding == (cfg.conv_kernel // 2,) for b in model.encoder.blocks
    )

    def refused(*args, **kwargs):
        raise AssertionError("the chunk path was taken")
    monkeypatch.setattr(conformer, "chunk_mask", refused)
    monkeypatch.setattr(ConformerEncoder, "draw_chunk", refused)
    feats, lens = torch.randn(2, 120, 80), torch.tensor([120, 90])
    model.train()
    out = Objective(spec_augment=SpecAugment())(
        model, feats, lens, torch.tensor([[5, 6, 7], [8, 9, -1]]), torch.tensor([3, 2]))
    out.loss.backward()
    model.eval()
    with torch.no_grad():
        assert torch.equal(model.encode(feats, lens)[0], model.encode(feats, lens, chunk_size=0)[0])


def test_a_full_context_config_and_a_streaming_one_load_as_stored():
    cfg = ModelConfig.from_dict(dict(vars(model_config_from_preset("tiny", vocab_size=V))))
    assert (cfg.dynamic_chunk, cfg.dynamic_left_chunks, cfg.causal_conv) == (False, False, False)
    assert not any(b.conv_module.causal for b in ASRModel(cfg).encoder.blocks)
    streaming = vars(
        model_config_from_preset(
            "tiny", vocab_size=V, dynamic_chunk=True, causal_conv=True, max_chunk=8
        )
    )
    assert ModelConfig.from_dict(streaming) == ModelConfig(**streaming)


def test_dynamic_chunk_draws_a_chunk_per_training_batch_and_trains():
    model = _model(
        dynamic_chunk=True, dynamic_left_chunks=True, max_chunk=8, causal_conv=True, dropout=0.0
    )
    encoder = model.encoder
    torch.manual_seed(3)
    draws = [encoder.draw_chunk(30) for _ in range(300)]
    assert (0, -1) in draws
    chunks = {c for c, _ in draws if c}
    assert chunks == set(range(1, 9))
    assert all(0 <= left <= 29 // c for c, left in draws if c)
    assert len({left for c, left in draws if c == 1}) > 5

    # A training forward draws with torch's generator: the same seed, the same chunks.
    feats, lens = torch.randn(2, 130, 80), torch.tensor([130, 100])
    seen = set()
    for seed in range(6):
        torch.manual_seed(seed)
        chunk, left = encoder.draw_chunk(31)
        seen.add(chunk)
        torch.manual_seed(seed)
        trained = encoder.train()(feats, lens)[0]
        with torch.no_grad():
            torch.testing.assert_close(
                trained, encoder.eval()(feats, lens, chunk_size=chunk, left_chunks=left)[0]
            )
    assert len(seen) > 1

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens, token_lens = torch.tensor([[5, 6, 7], [8, 9, -1]]), torch.tensor([3, 2])
    for _ in range(4):
        out = Objective(spec_augment=SpecAugment())(model, feats, lens, tokens, token_lens)
        assert torch.isfinite(out.loss)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_a_model_trained_with_dynamic_chunk_decodes_the_same_ctc_text_chunk_by_chunk():
    model = _model(dynamic_chunk=True, causal_conv=True, max_chunk=8, dropout=0.0)
    ctc_alone = Objective(ctc_weight=1.0)  # the CTC branch alone: it learns to emit sooner
    torch.manual_seed(2)
    feats, lens = torch.randn(2, 190, 80) * 2 + 1, torch.tensor([190, 190])
    model.set_cmvn(feats.mean((0, 1)), feats.std((0, 1)))
    tokens, token_lens = torch.randint(3, V, (2, 8)), torch.tensor([8, 8])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(150):  # memorizes the two utterances far enough to emit some tokens
        ctc_alone(model, feats, lens, tokens, token_lens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    emitted = 0
    with torch.no_grad():
        for chunk, left in [(1, -1), (4, -1), (4, 2), (8, 1)]:
            full = model.ctc_log_probs(
                model.encode(feats, lens, chunk_size=chunk, left_chunks=left)[0]
            ).argmax(-1)
            for b in range(2):
                enc = model.encoder.forward_chunk_by_chunk(
                    model.normalize(feats[b : b + 1]), chunk, left
                )
                streamed = model.ctc_log_probs(enc).argmax(-1)[0]
                assert streamed.tolist() == full[b].tolist()
                emitted += int((streamed != 0).sum())
    assert emitted > 0  # not all blank: the comparison sees tokens
