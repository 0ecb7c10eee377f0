"""Transformer decoder (pre-norm) attending to the Conformer encoder's states."""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .conformer import (
    Dropout,
    FeedForward,
    KVCache,
    LayerNorm,
    MultiHeadAttention,
    RotaryEmbedding,
    aligned_length,
    run_layers,
)
from .masks import causal_mask, pad_mask


class DecoderState(NamedTuple):
    """What incremental decoding keeps: the encoder states and which of their frames are real, one
    row per utterance; the attention caches (``KVCache``) of the layers: self-attention keys and
    values of the tokens so far, one row per hypothesis, and cross-attention keys and values of the
    encoder states, one row per utterance (its hypotheses share them)."""

    memory: torch.Tensor  # (B, T', D)
    cross_allowed: torch.Tensor  # (B, 1, 1, T')
    self_kv: KVCache  # (N, H, U, D/H) each, N = B * hypotheses
    cross_kv: KVCache  # (B, H, T', D/H) each

    def select(self, rows: torch.Tensor) -> DecoderState:
        """Keep the hypotheses ``rows`` (beam search reorders and copies them); each must stay
        with its utterance: row r belongs to utterance r // (N / B)."""
        return self._replace(self_kv={m: (k[rows], v[rows]) for m, (k, v) in self.self_kv.items()})


__all__ = ["DecoderLayer", "DecoderState", "TransformerDecoder"]


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention to the encoder, feed-forward; each pre-norm
    residual."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        ffn_dim: int,
        dropout: float,
        attention_dropout: float = 0.0,
    ):
        super().__init__()
        self.self_norm = LayerNorm(d_model)
        self.self_attn = MultiHeadAttention(d_model, n_heads, attention_dropout)
        self.cross_norm = LayerNorm(d_model)
        self.cross_attn = MultiHeadAttention(d_model, n_heads, attention_dropout)
        self.ffn = FeedForward(d_model, ffn_dim, dropout)
        self.dropout = Dropout(dropout)

    def forward(self, y: torch.Tensor, self_allowed: Optional[torch.Tensor], memory: torch.Tensor,
                cross_allowed: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                state: Optional[DecoderState] = None) -> torch.Tensor:
        """``state``: incremental decoding (``y`` the new positions, whose keys and values the
        state's caches keep); None in training."""
        self_cache, cross_cache = (None, None) if state is None else (state.self_kv, state.cross_kv)
        y = y + self.dropout(
            self.self_attn(self.self_norm(y), None, self_allowed, rope, self_cache)
        )
        y = y + self.dropout(
            self.cross_attn(self.cross_norm(y), memory, cross_allowed, cache=cross_cache)
        )
        return y + self.ffn(y)


class TransformerDecoder(nn.Module):
    """Token prefixes + encoder states -> next-token logits."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.d_model = cfg.d_model
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.rotary = RotaryEmbedding(cfg.d_model // cfg.n_heads)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg.d_model, cfg.n_heads, cfg.ffn_dim, cfg.dropout, cfg.attention_dropout)
            for _ in range(cfg.decoder_layers)
        )
        self.final_norm = LayerNorm(cfg.d_model)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size)
        self.gradient_checkpointing = False  # set by ASRModel.set_gradient_checkpointing

    def forward(self, tokens: torch.Tensor, token_lens: torch.Tensor, memory: torch.Tensor,
                memory_lens: torch.Tensor) -> torch.Tensor:
        """
        Args:
            tokens: ``(B, U)`` input ids, starting with ``<sos/eos>``; padding may hold any id.
            token_lens: ``(B,)`` real lengths of ``tokens``.
            memory: ``(B, T', D)`` encoder states.
            memory_lens: ``(B,)`` their lengths.
        Returns:
            ``(B, U, V)`` logits.
        """
        B, U = tokens.shape
        # (B, U) padded, see ALIGN
        tokens = F.pad(tokens, (0, aligned_length(U, tokens.device) - U))
        y = self.embed(tokens) * math.sqrt(self.d_model)  # (B, U, D)
        # Query i sees real keys j <= i. The first key is always real, so no row is fully masked.
        Up = tokens.shape[1]
        # (B, U, U)
        self_allowed = causal_mask(Up, tokens.device) & ~pad_mask(token_lens, Up)[:, None, :]
        self_allowed = self_allowed.unsqueeze(1)  # (B, 1, U, U)
        cross_allowed = ~pad_mask(memory_lens, memory.shape[1])[:, None, None, :]  # (B, 1, 1, T')
        rope = self.rotary(Up, tokens.device)
        y = run_layers(self.layers, y, self_allowed, memory, cross_allowed, rope,
                       checkpointed=self.gradient_checkpointing and self.training)
        return self.output(self.final_norm(y[:, :U]))

    # ---- incremental decoding: one new token per hypothesis and step --------------------------

    def init_state(self, memory: torch.Tensor, memory_lens: torch.Tensor) -> DecoderState:
        """State before the first token for the utterances of ``memory`` ``(B, T', D)``; the first
        ``step`` decides how many hypotheses each has (its tokens' rows, a multiple of B)."""
        allowed = ~pad_mask(memory_lens, memory.shape[1])[:, None, None, :]
        return DecoderState(memory, allowed, {}, {})

    def step(self, tokens: torch.Tensor, state: DecoderState) -> tuple[torch.Tensor, DecoderState]:
        """Logits ``(N, V)`` after appending ``tokens`` ``(N,)`` to each hypothesis, and the new
        state. The same layers and numbers as ``forward`` on the whole prefix, computing only the
        new position.
        """
        # the caller's stays
        state = state._replace(self_kv=dict(state.self_kv), cross_kv=dict(state.cross_kv))
        position = next(iter(state.self_kv.values()))[0].shape[2] if state.self_kv else 0
        rope = self.rotary(position + 1, tokens.device)
        y = self.embed(tokens)[:, None] * math.sqrt(self.d_model)  # (N, 1, D)
        for layer in self.layers:
            y = layer(y, None, state.memory, state.cross_allowed, rope, state)
        return self.output(self.final_norm(y))[:, 0], state
