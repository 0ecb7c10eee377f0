"""Transformer decoder (pre-norm) attending to the Conformer encoder's states."""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .conformer import FeedForward, LayerNorm, MultiHeadAttention, RotaryEmbedding, _rotate, run_layers
from .config import ModelConfig
from .masks import causal_mask, pad_mask


class DecoderState(NamedTuple):
    """What incremental decoding keeps: per layer, the (rotated) self-attention keys and values of
    the tokens so far, one row per hypothesis; per layer, the cross-attention keys and values of
    the encoder states, one row per utterance (its hypotheses share them); which frames are real."""

    self_kv: list[tuple[torch.Tensor, torch.Tensor]]  # (N, H, U, D/H) each, N = B * hypotheses
    cross_kv: list[tuple[torch.Tensor, torch.Tensor]]  # (B, H, T', D/H) each
    cross_allowed: torch.Tensor  # (B, 1, 1, T')

    def select(self, rows: torch.Tensor) -> DecoderState:
        """Keep the hypotheses ``rows`` (beam search reorders and copies them); each must stay
        with its utterance: row r belongs to utterance r // (N / B)."""
        return DecoderState([(k[rows], v[rows]) for k, v in self.self_kv], self.cross_kv, self.cross_allowed)


def _heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    N, T, D = x.shape
    return x.view(N, T, n_heads, D // n_heads).transpose(1, 2)  # (N, H, T, D/H)

__all__ = ["DecoderLayer", "DecoderState", "TransformerDecoder"]


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention to the encoder, feed-forward; each pre-norm residual."""

    def __init__(self, d_model: int, n_heads: int, ffn_dim: int, dropout: float):
        super().__init__()
        self.self_norm = LayerNorm(d_model)
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout)
        self.cross_norm = LayerNorm(d_model)
        self.cross_attn = MultiHeadAttention(d_model, n_heads, dropout)
        self.ffn = FeedForward(d_model, ffn_dim, dropout)
        self.dropout = nn.Dropout(dropout)

    def forward(self, y: torch.Tensor, self_allowed: torch.Tensor, memory: torch.Tensor,
                cross_allowed: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h = self.self_norm(y)
        y = y + self.dropout(self.self_attn(h, h, self_allowed, rope))
        y = y + self.dropout(self.cross_attn(self.cross_norm(y), memory, cross_allowed))
        return y + self.ffn(y)


class TransformerDecoder(nn.Module):
    """Token prefixes + encoder states -> next-token logits."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.d_model = cfg.d_model
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.rotary = RotaryEmbedding(cfg.d_model // cfg.n_heads)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg.d_model, cfg.n_heads, cfg.ffn_dim, cfg.dropout) for _ in range(cfg.decoder_layers))
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
        y = self.embed(tokens) * math.sqrt(self.d_model)  # (B, U, D)
        # Query i sees real keys j <= i. The first key is always real, so no row is fully masked.
        self_allowed = causal_mask(U, tokens.device) & ~pad_mask(token_lens, U)[:, None, :]  # (B, U, U)
        self_allowed = self_allowed.unsqueeze(1)  # (B, 1, U, U)
        cross_allowed = ~pad_mask(memory_lens, memory.shape[1])[:, None, None, :]  # (B, 1, 1, T')
        rope = self.rotary(U, tokens.device)
        y = run_layers(self.layers, y, self_allowed, memory, cross_allowed, rope,
                       checkpointed=self.gradient_checkpointing and self.training)
        return self.output(self.final_norm(y))

    # ---- incremental decoding: one new token per hypothesis and step --------------------------

    def init_state(self, memory: torch.Tensor, memory_lens: torch.Tensor, hypotheses: int = 1) -> DecoderState:
        """State before the first token for ``hypotheses`` rows per utterance of ``memory``
        ``(B, T', D)``: each layer's cross-attention keys and values, projected once."""
        cross = []
        for layer in self.layers:
            attn = layer.cross_attn
            cross.append((_heads(attn.k_proj(memory), attn.n_heads), _heads(attn.v_proj(memory), attn.n_heads)))
        k = cross[0][0]
        empty = k.new_zeros(k.shape[0] * hypotheses, k.shape[1], 0, k.shape[3])
        allowed = ~pad_mask(memory_lens, memory.shape[1])[:, None, None, :]
        return DecoderState([(empty, empty)] * len(self.layers), cross, allowed)

    def step(self, tokens: torch.Tensor, state: DecoderState) -> tuple[torch.Tensor, DecoderState]:
        """Logits ``(N, V)`` after appending ``tokens`` ``(N,)`` to each hypothesis, and the new state.
        The same numbers as ``forward`` on the whole prefix, computing only the new position."""
        N, B = tokens.shape[0], state.cross_allowed.shape[0]
        position = state.self_kv[0][0].shape[2]
        cos, sin = self.rotary(position + 1, tokens.device)
        rope = (cos[position:], sin[position:])
        y = self.embed(tokens)[:, None] * math.sqrt(self.d_model)  # (N, 1, D)
        new_self = []
        for layer, (k_old, v_old), (k_mem, v_mem) in zip(self.layers, state.self_kv, state.cross_kv):
            attn = layer.self_attn
            h = layer.self_norm(y)
            q = _rotate(_heads(attn.q_proj(h), attn.n_heads), *rope)
            k = torch.cat([k_old, _rotate(_heads(attn.k_proj(h), attn.n_heads), *rope)], dim=2)
            v = torch.cat([v_old, _heads(attn.v_proj(h), attn.n_heads)], dim=2)
            new_self.append((k, v))
            y = y + attn.out_proj(_merge(F.scaled_dot_product_attention(q, k, v)))
            # The hypotheses of one utterance are the query positions of one cross-attention call.
            cross = layer.cross_attn
            q = cross.q_proj(layer.cross_norm(y)).view(B, N // B, -1)  # (B, hyps, D)
            out = F.scaled_dot_product_attention(_heads(q, cross.n_heads), k_mem, v_mem, attn_mask=state.cross_allowed)
            y = y + cross.out_proj(_merge(out).reshape(N, 1, -1))
            y = y + layer.ffn(y)
        logits = self.output(self.final_norm(y))[:, 0]
        return logits, DecoderState(new_self, state.cross_kv, state.cross_allowed)


def _merge(x: torch.Tensor) -> torch.Tensor:
    N, H, T, Dh = x.shape
    return x.transpose(1, 2).reshape(N, T, H * Dh)
