import pytest
import torch

from konkanivani.config import PRESETS, ConfigError, ModelConfig, model_config_from_preset
from konkanivani.model.asr import ASRModel, SpecAugment, count_parameters
from konkanivani.model.conformer import ConformerBlock
from konkanivani.model.decoder import DecoderLayer

V = 64


def _model(preset="tiny", **kw):
    torch.manual_seed(0)
    return ASRModel(model_config_from_preset(preset, vocab_size=V, **kw)).eval()


def test_shapes():
    model = _model()
    feats, lens = torch.randn(3, 157, 80), torch.tensor([157, 120, 33])
    enc, enc_lens = model.encode(feats, lens)
    assert enc.shape == (3, 38, 48)
    assert enc_lens.tolist() == [38, 29, 7]
    assert model.ctc_log_probs(enc).shape == (3, 38, V)
    tokens = torch.tensor([[5, 6, 7, 8], [9, 10, -1, -1], [11, -1, -1, -1]])
    logits = model.decoder(
        torch.cat([torch.full((3, 1), 2), tokens.clamp_min(0)], 1),
        torch.tensor([5, 3, 2]),
        enc,
        enc_lens,
    )
    assert logits.shape == (3, 5, V)
    out = model(feats, lens, tokens, torch.tensor([4, 2, 1]))
    assert out.inter_ctc is None  # no tap asked for
    assert all(t.shape == () and torch.isfinite(t) for t in (out.ctc, out.attention))


@pytest.mark.parametrize(
    "preset,low,high",
    [("large", 20e6, 35e6), ("medium", 7e6, 14e6), ("small", 2.5e6, 5e6), ("tiny", 1e5, 4e5)],
)
def test_preset_parameter_counts(preset, low, high):
    n = count_parameters(_model(preset))
    assert low < n < high, f"{preset}: {n:,}"


def test_presets_match_the_published_sizes():
    assert (
        PRESETS["large"]["d_model"],
        PRESETS["large"]["encoder_layers"],
        PRESETS["large"]["decoder_layers"],
    ) == (256, 12, 6)
    assert (
        PRESETS["medium"]["d_model"],
        PRESETS["medium"]["encoder_layers"],
        PRESETS["medium"]["decoder_layers"],
    ) == (192, 8, 4)
    assert (
        PRESETS["small"]["d_model"],
        PRESETS["small"]["encoder_layers"],
        PRESETS["small"]["decoder_layers"],
    ) == (128, 6, 3)


def test_layer_flags_add_exactly_one_block():
    cfg = model_config_from_preset("small")
    block = count_parameters(
        ConformerBlock(cfg.d_model, cfg.n_heads, cfg.ffn_dim, cfg.conv_kernel, 0.0)
    )
    layer = count_parameters(DecoderLayer(cfg.d_model, cfg.n_heads, cfg.ffn_dim, 0.0))
    base = count_parameters(_model("small"))
    assert count_parameters(_model("small", encoder_layers=7)) - base == block
    assert count_parameters(_model("small", decoder_layers=4)) - base == layer
    assert model_config_from_preset("small", d_model=96).d_model == 96


def test_both_front_ends_give_the_same_shapes():
    feats, lens = torch.randn(2, 157, 80), torch.tensor([157, 33])
    models = {kind: _model("small", subsampling=kind) for kind in ("dw_striding", "conv2d")}
    outs = {kind: m.encode(feats, lens) for kind, m in models.items()}
    assert outs["dw_striding"][0].shape == outs["conv2d"][0].shape == (2, 38, 128)
    assert outs["dw_striding"][1].tolist() == outs["conv2d"][1].tolist() == [38, 7]
    front = {kind: count_parameters(m.encoder.subsampling.conv) for kind, m in models.items()}
    assert front["dw_striding"] < front["conv2d"] / 4
    assert ModelConfig.from_dict(vars(models["dw_striding"].cfg)).subsampling == "dw_striding"
    with pytest.raises(ValueError, match="--subsampling conv3d: unknown"):
        model_config_from_preset("tiny", subsampling="conv3d")


def test_a_narrow_first_convolution_keeps_the_shapes():
    feats, lens = torch.randn(2, 157, 80), torch.tensor([157, 33])
    full, narrow = _model("small"), _model("small", subsampling_channels=32)
    for model in (full, narrow):
        out, out_lens = model.encode(feats, lens)
        assert out.shape == (2, 38, 128) and out_lens.tolist() == [38, 7]
    first, second = narrow.encoder.subsampling.conv[0], narrow.encoder.subsampling.conv[2]
    assert (first.out_channels, second.in_channels, second.out_channels) == (32, 32, 128)
    assert (
        count_parameters(full) - count_parameters(narrow)
        == (128 - 32) * (1 * 9 + 1) + (128 - 32) * 128 * 9
    )
    assert full.encoder.subsampling.conv[0].out_channels == 128  # 0: d_model
    for bad in (
        dict(subsampling_channels=-1),
        dict(subsampling_channels=32, subsampling="dw_striding"),
    ):
        with pytest.raises(ValueError, match="--subsampling_channels"):
            model_config_from_preset("tiny", **bad)


def test_utterance_cmvn_ignores_a_constant_gain_and_the_batch_padding():
    torch.manual_seed(1)
    feats, lens = torch.randn(2, 157, 80) * 2 + 1, torch.tensor([157, 60])
    feats[1, 60:] = 0.0  # zero padding, as collate and the Recognizer make it
    models = {kind: _model(cmvn=kind) for kind in ("global", "utterance")}
    for model in models.values():
        model.set_cmvn(feats[0].mean(0), feats[0].std(0))
    louder = feats.clone()
    louder[0] += 2.0  # every log-mel bin up by 2: the amplitude x e (the power x e^2)
    louder[1, :60] += torch.linspace(-1.0, 1.0, 80)  # a spectral tilt over the real frames
    with torch.no_grad():
        enc = {kind: model.encode(feats, lens)[0] for kind, model in models.items()}
        moved = {kind: model.encode(louder, lens)[0] for kind, model in models.items()}
        alone = models["utterance"].encode(louder[1:, :60], lens[1:])[0]
    assert torch.allclose(moved["utterance"], enc["utterance"], atol=1e-4)
    assert not torch.allclose(moved["global"], enc["global"], atol=1e-2)
    # the same without padding
    assert torch.allclose(alone[0], moved["utterance"][1, :alone.shape[1]], atol=1e-4)
    assert ModelConfig.from_dict(dict(vars(models["utterance"].cfg))).cmvn == "utterance"
    with pytest.raises(ValueError, match="--cmvn speaker: unknown"):
        model_config_from_preset("tiny", cmvn="speaker")


def test_bad_dimensions_are_refused():
    with pytest.raises(ValueError, match="heads"):
        model_config_from_preset("tiny", d_model=50, n_heads=4)
    with pytest.raises(ValueError, match="odd"):
        model_config_from_preset("tiny", conv_kernel=8)
    with pytest.raises(ValueError, match="--preset huge: unknown"):
        model_config_from_preset("huge")


def test_padding_does_not_change_outputs():
    """Each utterance alone gives the same encoder states and losses as inside a padded batch."""
    model = _model()
    feats = torch.randn(2, 130, 80)
    lens = torch.tensor([130, 71])
    tokens = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, -1, -1]])
    tok_lens = torch.tensor([5, 3])
    enc, enc_lens = model.encode(feats, lens)
    batch_out = model(feats, lens, tokens, tok_lens)
    single = [
        model(
            feats[i : i + 1, : lens[i]],
            lens[i : i + 1],
            tokens[i : i + 1, : tok_lens[i]],
            tok_lens[i : i + 1],
        )
        for i in range(2)
    ]
    for i in range(2):
        alone, _ = model.encode(feats[i:i + 1, :lens[i]], lens[i:i + 1])
        torch.testing.assert_close(enc[i, :enc_lens[i]], alone[0], rtol=1e-4, atol=1e-4)
    for name in ("ctc", "attention"):
        total = sum(getattr(s, name) for s in single)
        torch.testing.assert_close(getattr(batch_out, name), total, rtol=1e-4, atol=1e-3)


def test_spec_augment_only_in_training_mode():
    model = _model()
    feats, lens = torch.randn(2, 200, 80), torch.tensor([200, 200])
    masks = SpecAugment()
    a, _ = model.encode(feats, lens, augment=masks)
    b, _ = model.encode(feats, lens)
    torch.testing.assert_close(a, b)  # eval mode: no masking
    model.train()
    model.encoder.eval()  # keep dropout off, so only the masks can differ
    a, _ = model.encode(feats, lens, augment=masks)
    b, _ = model.encode(feats, lens)
    assert not torch.allclose(a, b)
    x = (feats - model.feat_mean) / model.feat_std
    masked = masks(x)
    assert (masked == 0).sum() > (x == 0).sum()


def test_cpu_dropout_drops_its_share_keeps_the_mean_and_repeats_with_the_seed():
    from konkanivani.model.conformer import Dropout

    drop = Dropout(0.1).train()
    x = torch.ones(64, 100, 128, requires_grad=True)
    torch.manual_seed(5)
    y = drop(x)
    dropped = (y == 0).float().mean().item()
    assert abs(dropped - 26 / 256) < 0.005  # p taken to 26/256
    assert abs(y.mean().item() - 1.0) < 0.01  # kept values scaled by 256/230
    y.sum().backward()
    assert torch.equal(x.grad == 0, y == 0)
    torch.manual_seed(5)
    assert torch.equal(drop(x), y)
    assert torch.equal(drop.eval()(x), x)


def test_cpu_dropout_trains_through_torch_compile():
    """Inside torch.compile the dropout is torch's: the byte view of the 64-bit draws broke
    AOTAutograd's aliasing (out-of-bounds storage at the first backward), so --compile fell back to
    eager. ``aot_eager`` runs that same tracing without needing a C++ compiler."""
    from konkanivani.model.conformer import Dropout

    drop = Dropout(0.1).train()
    x = torch.ones(8, 99, 512, requires_grad=True)
    y = torch.compile(lambda t: drop(t * 2), backend="aot_eager", fullgraph=True)(x)
    y.sum().backward()
    assert 0.05 < (y == 0).float().mean().item() < 0.15
    assert torch.equal(x.grad == 0, y == 0)


def test_a_stored_config_missing_a_field_or_with_an_unknown_one_is_refused_in_one_line():
    """A checkpoint's config names every field: one written before a field existed is refused
    (CHANGELOG.md), not built with today's default, which would make another model."""
    stored = dict(vars(model_config_from_preset("tiny", vocab_size=V, dropout=0.2)))
    assert ModelConfig.from_dict(stored) == ModelConfig(**stored)
    old = {k: v for k, v in stored.items() if k not in ("attention_dropout", "subsampling")}
    with pytest.raises(ConfigError, match=r"^the checkpoint's model config has no "
                       r"attention_dropout, subsampling: it was written by an earlier konkanivani"):
        ModelConfig.from_dict(old)
    with pytest.raises(ConfigError, match="has rope_base, unknown to this konkanivani"):
        ModelConfig.from_dict({**stored, "rope_base": 10000})
    assert model_config_from_preset("tiny").attention_dropout == 0.0
