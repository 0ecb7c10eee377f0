"""Transformer decoder (pre-norm) attending to the Conformer encoder's states."""
from __future__ import annotations

import math

import torch
from torch import nn

from .conformer import FeedForward, LayerNorm, MultiHeadAttention, RotaryEmbedding, run_layers
from .config import ModelConfig
from .masks import causal_mask, pad_mask

__all__ = ["DecoderLayer", "TransformerDecoder"]


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
