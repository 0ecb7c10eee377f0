"""Decoding a feature batch in one call, for tests that start from features rather than audio: the
model's encoder, then ``search.decode_encoded`` with the resolved settings of ``method`` (what the
recognizer does after its front-end)."""
from __future__ import annotations

import torch

from konkanivani.decoding.search import Fusion, decode_encoded
from konkanivani.decoding.settings import DecodingConfig


def decode_features(model, feats: torch.Tensor, feat_lens: torch.Tensor, method: str,
                    beam_size: int = DecodingConfig.beam_size,
                    fusion: Fusion | None = None) -> list[list[int]]:
    """Token ids per utterance of features ``(B, T, F)`` decoded with ``method``."""
    decoding = DecodingConfig(method=method, beam_size=beam_size).resolved(streams=False)
    enc, enc_lens = model.encode(feats, feat_lens)
    return decode_encoded(model, enc, enc_lens, feat_lens, decoding, fusion)
