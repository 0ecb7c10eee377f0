"""Masked prediction of random-projection codes (model/bestrq.py): frozen seeded targets, span
masks, their alignment with the encoder's frames, and a tiny encoder that learns to predict the
masked codes of tone speech below the codebook's chance level."""
import math

import torch
from tone_speech import SENTENCES, speech
from torch import nn

from konkanivani.config import model_config_from_preset
from konkanivani.data.features import LogMel
from konkanivani.data.frames import subsampled_lengths
from konkanivani.model.bestrq import (
    RandomProjectionQuantizer,
    mask_features,
    masked_frames,
    masked_prediction_loss,
    span_mask,
)
from konkanivani.model.conformer import ConformerEncoder


def test_the_codes_are_fixed_by_the_seed_and_use_the_codebook():
    feats = torch.randn(3, 400, 80, generator=torch.Generator().manual_seed(0))
    a, b = (RandomProjectionQuantizer(80, 256, seed=7)(feats, 100) for _ in range(2))
    other = RandomProjectionQuantizer(80, 256, seed=8)(feats, 100)
    assert torch.equal(a, b) and not torch.equal(a, other)
    assert a.shape == (3, 100) and int(a.min()) >= 0 and int(a.max()) < 256
    assert len(a.unique()) > 100  # random features spread over the codebook
    # a code is that of its own four frames: changing frames 8..11 changes code 2 alone
    changed = feats.clone()
    changed[:, 8:12] = torch.randn(3, 4, 80, generator=torch.Generator().manual_seed(1))
    c = RandomProjectionQuantizer(80, 256, seed=7)(changed, 100)
    differs = (c != a).any(0)
    assert differs[2] and not differs[:2].any() and not differs[3:].any()


def test_the_quantizer_is_frozen_and_travels_in_the_state_dict():
    q = RandomProjectionQuantizer(80, 64, seed=3)
    assert not list(q.parameters())
    assert set(q.state_dict()) == {"projection", "codebook"}
    assert torch.allclose(q.codebook.norm(dim=-1), torch.ones(64))


def test_span_masks_stay_within_each_utterance_and_cover_about_their_share():
    lengths = torch.tensor([2000, 1200, 50])
    mask = span_mask(lengths, 2000, prob=0.02, span=10, generator=torch.Generator().manual_seed(0))
    assert not mask[1, 1200:].any() and not mask[2, 50:].any()
    share = mask[0].float().mean().item()
    expected = 1 - (1 - 0.02) ** 10
    assert abs(share - expected) < 0.06, (share, expected)
    # spans: every masked run is at least ``span`` frames unless cut by the utterance's end
    runs = torch.diff(mask[0].int(), prepend=torch.zeros(1, dtype=torch.int32),
                      append=torch.zeros(1, dtype=torch.int32))
    starts, ends = (runs == 1).nonzero().flatten(), (runs == -1).nonzero().flatten()
    assert len(starts) and bool(((ends - starts) >= 10).all())


def test_masked_features_are_noise_where_masked_and_untouched_elsewhere():
    feats = torch.full((2, 40, 8), 5.0)
    mask = torch.zeros(2, 40, dtype=torch.bool)
    mask[0, 4:12] = True
    out = mask_features(feats, mask, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out[~mask], feats[~mask])
    assert out[mask].abs().max() < 1.0
    frames = masked_frames(mask, 9)
    assert frames[0].tolist() == [False, True, True, False, False, False, False, False, False]
    assert not frames[1].any()


def test_a_tiny_encoder_learns_the_masked_codes_below_chance():
    torch.manual_seed(0)
    cfg = model_config_from_preset("tiny", vocab_size=10)
    encoder = ConformerEncoder(cfg)
    quantizer = RandomProjectionQuantizer(cfg.n_mels, codebook_size=64, seed=0)
    head = nn.Linear(cfg.d_model, quantizer.codebook_size)
    front = LogMel(cfg.n_mels)
    wavs = [speech(s, seed=i) for i, s in enumerate(SENTENCES * 2)]
    feats = [front(w) for w in wavs]
    lengths = torch.tensor([len(f) for f in feats])
    batch = nn.utils.rnn.pad_sequence(feats, batch_first=True)
    batch = (batch - batch.mean((0, 1))) / batch.std((0, 1))
    frames = int(subsampled_lengths(lengths).max())
    codes = quantizer(batch, frames)
    optimizer = torch.optim.AdamW([*encoder.parameters(), *head.parameters()], lr=2e-3)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(60):
        mask = span_mask(lengths, batch.shape[1], 0.04, 10, generator)
        states, state_lens = encoder(mask_features(batch, mask, generator=generator), lengths)
        loss, count = masked_prediction_loss(states, state_lens, codes,
                                             masked_frames(mask, states.shape[1]), head)
        optimizer.zero_grad()
        (loss / count).backward()
        optimizer.step()
        losses.append(loss.item() / count)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    chance = math.log(quantizer.codebook_size)
    assert last < first and last < chance - 0.5, (first, last, chance)
