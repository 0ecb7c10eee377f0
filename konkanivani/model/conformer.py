"""Conformer encoder (Gulati et al., 2020), batch-first, pre-norm.

Letters used for shapes across the package:
    B batch, T input frames, T' frames after 4x subsampling, U tokens, D model width,
    H attention heads, V vocabulary, F feature bins.

Positional information enters through rotary embeddings (RoPE) on queries and keys: relative
positions like Transformer-XL style attention, but still one fused ``scaled_dot_product_attention``
call, which keeps memory low on small GPUs.

Streaming (docs/architecture.md, "Streaming"): under a chunk mask (``masks.chunk_mask``) and with
causal convolutions, ``ConformerEncoder.forward_chunk`` encodes a stream one chunk at a time with
caches and gives the frames the full forward gives under the same mask.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import ModelConfig, time_reduced_blocks
from ..data.frames import subsampled_lengths
from .masks import chunk_mask, pad_mask

__all__ = [
    "ALIGN",
    "aligned_length",
    "Dropout",
    "random_bytes",
    "LayerNorm",
    "RotaryEmbedding",
    "KVCache",
    "MultiHeadAttention",
    "FeedForward",
    "ConvolutionModule",
    "ConformerBlock",
    "Conv2dSubsampling",
    "ConformerEncoder",
    "StreamState",
    "feature_windows",
    "run_layers",
]


# On CUDA the frame axis of the encoder (and the token axis of the decoder) is padded to a multiple
# of this many positions, masked like any padding: every attention mask then has rows whose length
# is a multiple of 8, the alignment the memory-efficient SDPA kernel needs of a mask that was
# copied (activation offload saves it contiguous: a row of 374 frames failed with "attn_bias is not
# correctly aligned"), tensor cores get aligned matrices, and torch.compile sees fewer lengths.
ALIGN = 8


def aligned_length(length: int, device: torch.device) -> int:
    """``length`` rounded up to a multiple of ``ALIGN`` on CUDA; as it is elsewhere (a CPU gains
    nothing from padding and would compute the extra frames).

    >>> aligned_length(374, torch.device("cuda")), aligned_length(374, torch.device("cpu"))
    (376, 374)
    """
    return -(-length // ALIGN) * ALIGN if device.type == "cuda" else length


class LayerNorm(nn.LayerNorm):
    """LayerNorm computed and returned in float32 even under autocast: CUDA autocast already does
    this, CPU autocast would normalize in bf16/fp16. The parameters are those of ``nn.LayerNorm``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # autocast runs layer_norm in float32 on CUDA: no casts of our own (3 kernels)
        if x.is_cuda:
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        with torch.autocast(x.device.type, enabled=False):
            weight = None if self.weight is None else self.weight.float()
            bias = None if self.bias is None else self.bias.float()
            return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps)


def random_bytes(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """A uint8 tensor of ``shape``, uniform over 0..255, from the default generator: eight bytes per
    64-bit draw, where ``bernoulli_`` draws once per element (on a CPU, 17x slower)."""
    n = math.prod(shape)
    words = torch.empty(-(-n // 8), dtype=torch.int64, device=device).random_(-2 ** 63, None)
    return words.view(torch.uint8)[:n].view(shape)


def _compiling() -> bool:
    is_compiling = getattr(torch.compiler, "is_compiling", None)  # torch 2.3 has it; be safe
    return bool(is_compiling and is_compiling())


class Dropout(nn.Dropout):
    """``nn.Dropout``, with CPU masks drawn from one random byte per element (``random_bytes``):
    ``p`` is then taken to the nearest multiple of 1/256 and the kept values scaled by the matching
    factor. Drawing masks element by element was a sixth of a training step on a CPU. On other
    devices, and inside ``torch.compile`` (whose generated code draws its own masks, and which
    mis-handles the byte view of the 64-bit draws), torch's dropout."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0 or x.device.type != "cpu" or _compiling():
            return super().forward(x)
        dropped = round(self.p * 256)  # of every 256 byte values, this many drop the element
        keep = random_bytes(x.shape, x.device) >= dropped
        return torch.where(keep, x, 0.0) * (256 / (256 - dropped))


def run_layers(
    layers: nn.ModuleList, x: torch.Tensor, *args: object, checkpointed: bool = False
) -> torch.Tensor:
    """``x = layer(x, *args)`` for each layer; with ``checkpointed`` (in training) each layer's
    activations are recomputed in the backward pass instead of kept (non-reentrant
    ``torch.utils.checkpoint``; dropout draws the same masks again)."""
    for layer in layers:
        if checkpointed and torch.is_grad_enabled():
            x = checkpoint(_states_of, layer, x, *args, use_reentrant=False)
        else:
            x = _states_of(layer, x, *args)
    return x


def _states_of(layer: nn.Module, x: torch.Tensor, *args: object) -> torch.Tensor:
    """``layer(x, *args)``'s states, the first of what a ``ConformerBlock`` returns."""
    out = layer(x, *args)
    return out[0] if isinstance(out, tuple) else out


class RotaryEmbedding(nn.Module):
    """cos/sin tables for rotary position embeddings of width ``head_dim``."""

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables of positions 0 .. ``length - 1``, ``(T, hd)`` each."""
        return self.at(torch.zeros((), dtype=torch.int64, device=device), length)

    def at(self, offset: torch.Tensor, frames: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables of positions ``offset`` .. ``offset + frames - 1`` only, ``offset`` an int64
        tensor (an exported graph's input, whose value the graph does not know)."""
        positions = (offset + torch.arange(frames, device=offset.device)).float()
        angles = positions[:, None] * self.inv_freq.to(offset.device)[None, :]  # (T, hd/2)
        angles = torch.cat([angles, angles], dim=-1)  # (T, hd)
        return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


# attention module -> its (keys, values), each (N, H, T, D/H); see MultiHeadAttention
KVCache = dict


class MultiHeadAttention(nn.Module):
    """Multi-head attention over ``scaled_dot_product_attention``. ``forward``: the decoder's and
    the LM's self- or cross-attention, with an optional key/value cache for incremental decoding
    (one path for training and search); ``self_attention``: the encoder's, over a whole utterance
    or a stream's chunk after the keys and values of its past (one path for training, streams and
    the exported graph)."""

    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        N, T, D = x.shape
        return x.view(N, T, self.n_heads, D // self.n_heads).transpose(1, 2)  # (N, H, T, D/H)

    def forward(
        self,
        query: torch.Tensor,
        memory: Optional[torch.Tensor] = None,
        allowed: Optional[torch.Tensor] = None,
        rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        cache: Optional[KVCache] = None,
    ) -> torch.Tensor:
        """
        Args:
            query: ``(N, Tq, D)``. memory: ``(B, Tk, D)`` keys and values of cross-attention; None
            for self-attention. allowed: bool, broadcastable to ``(N, H, Tq, Tk)``, True where
            attention is allowed. rope: ``(cos, sin)`` of shape ``(T, D/H)``, rotary tables
            (self-attention only), row p for position p. cache: incremental decoding. Self-attention
            appends the new keys and values to ``cache[self]`` (the queries are the positions after
            those cached); cross-attention projects ``memory`` once and reuses it. Cross-attention
            memory may have fewer rows than the queries: the N = B x K hypotheses of an utterance
            share its row. The queries are at the positions after the cached keys, for ``rope``.
            (The encoder's self-attention is ``self_attention``.)
        Returns:
            ``(N, Tq, D)``.
        """
        N, Tq, D = query.shape
        q = self._heads(self.q_proj(query))  # (N, H, Tq, D/H)
        if memory is not None and cache is not None and self in cache:
            k, v = cache[self]
        else:
            source = query if memory is None else memory
            # (., H, Tk, D/H)
            k, v = self._heads(self.k_proj(source)), self._heads(self.v_proj(source))
        if rope is not None:
            offset = cache[self][0].shape[2] if cache is not None and self in cache else 0
            # the new positions' tables
            cos, sin = rope[0][offset:offset + Tq], rope[1][offset:offset + Tq]
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if cache is not None:
            if memory is None and self in cache:
                k, v = torch.cat([cache[self][0], k], dim=2), torch.cat([cache[self][1], v], dim=2)
            cache[self] = (k, v)
        B = k.shape[0]
        if B != N:  # hypotheses of one utterance: query positions of one call against its memory
            q = (
                q.reshape(B, N // B, self.n_heads, Tq, -1)
                .transpose(1, 2)
                .reshape(B, self.n_heads, N // B * Tq, -1)
            )
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed,
                                             dropout_p=self.dropout if self.training else 0.0)
        if B != N:
            out = (
                out.reshape(B, self.n_heads, N // B, Tq, -1)
                .transpose(1, 2)
                .reshape(N, self.n_heads, Tq, -1)
            )
        return self.out_proj(out.transpose(1, 2).reshape(N, Tq, D))

    def self_attention(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        allowed: Optional[torch.Tensor],
        past: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The encoder's self-attention, for a whole utterance and for a stream's chunk alike.

        Args:
            x: ``(B, C, D)``. rope: ``(cos, sin)`` of the chunk's positions, ``(C, D/H)``, or
            ``(B, 1, C, D/H)`` where each row is at its own position. allowed: bool, broadcastable
            to ``(B, H, C, P + C)``, True where a query may attend to a key; None: every key.
            past: ``(2, B, H, P, D/H)``, the keys (rotated) and values of the P frames before the
            chunk that it may see (rows padded before their past masked out by ``allowed``);
            None: none.
        Returns:
            ``(B, C, D)``, and the keys and values ``(B, H, P + C, D/H)`` each: the past's, then
            the chunk's.
        """
        B, C, D = x.shape
        q = self._heads(self.q_proj(x))  # (B, H, C, D/H)
        k, v = self._heads(self.k_proj(x)), self._heads(self.v_proj(x))
        q, k = _rotate(q, *rope), _rotate(k, *rope)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed,
                                             dropout_p=self.dropout if self.training else 0.0)
        return self.out_proj(out.transpose(1, 2).reshape(B, C, D)), (k, v)


class FeedForward(nn.Module):
    """Pre-norm position-wise feed-forward with Swish."""

    def __init__(self, d_model: int, ffn_dim: int, dropout: float):
        super().__init__()
        self.net = nn.Sequential(
            LayerNorm(d_model), nn.Linear(d_model, ffn_dim), nn.SiLU(), Dropout(dropout),
            nn.Linear(ffn_dim, d_model), Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ConvolutionModule(nn.Module):
    """Pointwise conv + GLU, depthwise conv, norm, Swish, pointwise conv.

    LayerNorm rather than BatchNorm after the depthwise convolution: T4 recipes train with two
    utterances per micro-batch, where batch statistics are noise.

    ``causal``: the depthwise convolution sees the frame and the ``kernel_size - 1`` before it
    (zeros before the first frame), no later one, so a stream needs no look-ahead
    (``forward_chunk``).
    """

    def __init__(self, d_model: int, kernel_size: int, dropout: float, causal: bool = False):
        super().__init__()
        self.causal = causal
        self.past = kernel_size - 1  # the frames before one that a causal kernel sees
        self.norm = LayerNorm(d_model)
        self.pointwise_in = nn.Linear(d_model, 2 * d_model)
        self.depthwise = nn.Conv1d(
            d_model, d_model, kernel_size, padding=0 if causal else kernel_size // 2, groups=d_model
        )
        self.depthwise_norm = LayerNorm(d_model)
        self.pointwise_out = nn.Linear(d_model, d_model)
        self.dropout = Dropout(dropout)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        """``x`` ``(B, T', D)``, ``pad`` ``(B, T')`` True at padding -> ``(B, T', D)``."""
        x = F.glu(self.pointwise_in(self.norm(x)), dim=-1)  # (B, T', D)
        # Zero the padding so it does not leak into real frames near the end through the kernel.
        x = x.masked_fill(pad.unsqueeze(-1), 0.0)
        if self.causal:
            x = F.pad(x, (0, 0, self.past, 0))  # zeros before the first frame
        return self._depthwise_on(x)

    def forward_chunk(self, x: torch.Tensor, cache: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """One chunk of a stream (``causal`` only): ``x`` ``(B, C, D)`` and ``cache`` ``(B,
        kernel-1, D)``, the depthwise convolution's inputs just before the chunk (zeros at the
        start) -> ``(B, C, D)`` and the cache for the next chunk."""
        x = F.glu(self.pointwise_in(self.norm(x)), dim=-1)  # (B, C, D)
        x = torch.cat([cache, x], dim=1)  # (B, kernel-1 + C, D)
        return self._depthwise_on(x), x[:, x.shape[1] - self.past:]

    def _depthwise_on(self, x: torch.Tensor) -> torch.Tensor:
        """The depthwise convolution over ``x`` ``(B, T, D)`` (with its left context when causal),
        norm, Swish, pointwise conv, dropout."""
        x = self.depthwise(x.transpose(1, 2)).transpose(1, 2)  # (B, D, T) conv, back to (B, T', D)
        x = self.pointwise_out(F.silu(self.depthwise_norm(x)))
        return self.dropout(x)


class ConformerBlock(nn.Module):
    """Half-step FFN, self-attention, convolution, half-step FFN, final norm."""

    def __init__(self, d_model: int, n_heads: int, ffn_dim: int, conv_kernel: int, dropout: float,
                 attention_dropout: float = 0.0, causal_conv: bool = False):
        super().__init__()
        self.ffn1 = FeedForward(d_model, ffn_dim, dropout)
        self.attn_norm = LayerNorm(d_model)
        self.attn = MultiHeadAttention(d_model, n_heads, attention_dropout)
        self.attn_dropout = Dropout(dropout)
        self.conv_module = ConvolutionModule(d_model, conv_kernel, dropout, causal=causal_conv)
        self.ffn2 = FeedForward(d_model, ffn_dim, dropout)
        self.final_norm = LayerNorm(d_model)

    def forward(
        self,
        x: torch.Tensor,
        pad: Optional[torch.Tensor],
        rope: tuple[torch.Tensor, torch.Tensor],
        allowed: Optional[torch.Tensor] = None,
        past: Optional[torch.Tensor] = None,
        conv_cache: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], Optional[torch.Tensor]]:
        """The block, for training, chunked streams, batched streams and the exported chunk graph.

        Args:
            x: ``(B, C, D)``: a whole utterance's frames, or a stream's chunk. pad: ``(B, C)`` True
            at padding, for a whole utterance (None for a chunk). rope, allowed, past: as
            ``MultiHeadAttention.self_attention`` (``allowed`` None with ``pad``: every frame sees
            every real frame). conv_cache: ``(B, kernel - 1, D)``, a chunk's convolution cache
            (``ConvolutionModule.forward_chunk``); None for a whole utterance.
        Returns:
            ``(B, C, D)``, the attention's keys and values (past and chunk), and the convolution's
            cache for the next chunk (None for a whole utterance).
        """
        x = x + 0.5 * self.ffn1(x)
        if allowed is None and pad is not None:
            allowed = ~pad[:, None, None, :]  # (B, 1, 1, T'): every query may see every real frame
        attended, keys_values = self.attn.self_attention(self.attn_norm(x), rope, allowed, past)
        x = x + self.attn_dropout(attended)
        if conv_cache is None:
            conv = self.conv_module(x, pad)
        else:
            conv, conv_cache = self.conv_module.forward_chunk(x, conv_cache)
        x = x + conv
        x = x + 0.5 * self.ffn2(x)
        return self.final_norm(x), keys_values, conv_cache


class Conv2dSubsampling(nn.Module):
    """Two stride-2 3x3 convolutions: ``(B, T, F)`` -> ``(B, T', D)`` with T' = ((T-1)//2 - 1)//2.

    ``depthwise_separable`` (the ``dw_striding`` front-end, FastConformer's) makes the second one a
    depthwise 3x3 followed by a pointwise 1x1: the same shapes and 4x rate (character targets need
    the frame rate) for about a ninth of the second convolution's work, which with full convolutions
    costs as much as several Conformer blocks. It runs channels-last (oneDNN's fast layout on a CPU,
    and the layout in which the pointwise conv is a plain matmul), so it flattens each output frame
    frequency-major where ``conv2d`` flattens it channel-major.

    ``channels`` (0: ``d_model``) narrows the first convolution's output, as icefall's front-ends
    do: the second convolution's work falls in proportion (a quarter of it at 32 channels for
    D=128).

    Output frame t comes from input frames ``4t`` .. ``4t + 6``: ``STRIDE`` and ``RECEPTIVE_FIELD``.
    """

    STRIDE, RECEPTIVE_FIELD = 4, 7

    @classmethod
    def window_frames(cls, frames: int) -> int:
        """The feature frames that make ``frames`` (>= 1) output frames, the subsampling's
        receptive field over them: ``(frames - 1) * 4 + 7``."""
        return (frames - 1) * cls.STRIDE + cls.RECEPTIVE_FIELD

    def __init__(self, n_mels: int, d_model: int, dropout: float, depthwise_separable: bool = False,
                 channels: int = 0):
        super().__init__()
        self.depthwise_separable = depthwise_separable
        c = channels or d_model  # the first convolution's output channels
        second = (
            [
                nn.Conv2d(d_model, d_model, 3, stride=2, groups=d_model),
                nn.Conv2d(d_model, d_model, 1),
            ]
            if depthwise_separable
            else [nn.Conv2d(c, d_model, 3, stride=2)]
        )
        self.conv = nn.Sequential(nn.Conv2d(1, c, 3, stride=2), nn.ReLU(), *second, nn.ReLU())
        freq_out = ((n_mels - 1) // 2 - 1) // 2
        self.out = nn.Linear(d_model * freq_out, d_model)
        self.dropout = Dropout(dropout)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.depthwise_separable:
            x = self._depthwise_separable(x.unsqueeze(1))  # (B, T', F', D)
        else:
            x = self.conv(x.unsqueeze(1)).transpose(1, 2)  # (B, D, T', F') -> (B, T', D, F')
        B, T = x.shape[:2]
        return self.dropout(self.out(x.reshape(B, T, -1))), subsampled_lengths(lengths)

    def _depthwise_separable(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, 1, T, F)`` -> ``(B, T', F', D)``, the convolutions in channels-last layout."""
        first, _, depthwise, pointwise, _ = self.conv
        cl = torch.channels_last
        x = F.relu(F.conv2d(x, first.weight.to(memory_format=cl), first.bias, stride=2))
        x = F.conv2d(
            x,
            depthwise.weight.to(memory_format=cl),
            depthwise.bias,
            stride=2,
            groups=depthwise.groups,
        )
        x = x.permute(0, 2, 3, 1)  # (B, D, T', F') stored channels-last -> (B, T', F', D), no copy
        return F.relu(F.linear(x, pointwise.weight.flatten(1), pointwise.bias))


class StreamState(NamedTuple):
    """What chunk-by-chunk encoding carries from one chunk to the next
    (``ConformerEncoder.forward_chunk``, ``forward_chunk_of_streams``), for B streams in step, with
    N blocks: one layout for every path, ``ChunkGraph``'s with a batch axis."""

    offset: int  # encoder frames made so far: the position of the next chunk's first frame
    # (N, 2, B, H, P, D/H): each block's keys (rotated) and values of the visible past
    keys_values: torch.Tensor
    # (N, B, kernel - 1, D): each block's depthwise convolution's last kernel - 1 inputs
    conv_inputs: torch.Tensor


def feature_windows(feats: torch.Tensor, chunk_size: int) -> list[torch.Tensor]:
    """``(B, T, F)`` -> the feature windows that ``ConformerEncoder.forward_chunk`` turns into
    chunks of ``chunk_size`` encoder frames: ``Conv2dSubsampling.window_frames(chunk_size)`` frames
    each, the next ``4 * chunk_size`` frames later (they overlap by 3); the last may be shorter and
    make fewer encoder frames. Together they make the ``subsampled_lengths(T)`` frames of the whole.

    >>> # 4 + 4 + 3 = 11 encoder frames
    >>> [w.shape[1] for w in feature_windows(torch.zeros(1, 50, 80), 4)]
    [19, 19, 18]
    """
    stride, receptive_field = Conv2dSubsampling.STRIDE, Conv2dSubsampling.RECEPTIVE_FIELD
    size = Conv2dSubsampling.window_frames(chunk_size)
    return [
        feats[:, start : start + size]
        for start in range(0, feats.shape[1] - receptive_field + 1, stride * chunk_size)
    ]


def _cached_frames(state: Optional[StreamState]) -> int:
    """The encoder frames of the past that ``state``'s attention caches hold."""
    return 0 if state is None else state.keys_values.shape[4]


def _chunk_allowed(pad: torch.Tensor, chunk_size: int, left_chunks: int) -> torch.Tensor:
    """``(B, 1, T', T')``: the chunk mask among real frames. A padding frame's row sees every real
    frame, as without chunks: a row that sees nothing would make the attention NaN."""
    chunks = chunk_mask(pad.shape[1], chunk_size, left_chunks, pad.device)  # (T', T')
    return ((chunks | pad[:, :, None]) & ~pad[:, None, :]).unsqueeze(1)


class ConformerEncoder(nn.Module):
    """Log-mel features to encoder states.

    Examples:
        >>> enc = ConformerEncoder(ModelConfig(d_model=48, n_heads=2, ffn_dim=96, encoder_layers=2))
        >>> out, lengths = enc(torch.randn(2, 100, 80), torch.tensor([100, 60]))
        >>> out.shape, lengths.tolist()
        (torch.Size([2, 24, 48]), [24, 14])
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.subsampling = Conv2dSubsampling(cfg.n_mels, cfg.d_model, cfg.dropout,
                                             depthwise_separable=cfg.subsampling == "dw_striding",
                                             channels=cfg.subsampling_channels)
        self.rotary = RotaryEmbedding(cfg.d_model // cfg.n_heads)
        self.blocks = nn.ModuleList(
            ConformerBlock(
                cfg.d_model,
                cfg.n_heads,
                cfg.ffn_dim,
                cfg.conv_kernel,
                cfg.dropout,
                cfg.attention_dropout,
                causal_conv=cfg.causal_conv,
            )
            for _ in range(cfg.encoder_layers)
        )
        self.gradient_checkpointing = False  # set by ASRModel.set_gradient_checkpointing
        # Progressive time reduction (Squeezeformer's): blocks after..until at half the frame rate
        self.reduced = time_reduced_blocks(cfg)
        self.time_reduce = (nn.Conv1d(cfg.d_model, cfg.d_model, 3, stride=2, padding=1,
                                      groups=cfg.d_model) if self.reduced[0] else None)
        # Self-conditioned CTC (ESPnet's): after block self_condition_layer the CTC head's
        # posteriors (B, T', V) times this (V, D) are added to the states; one row per token, as
        # the CTC head's own (ASRModel.VOCABULARY_TENSORS). Initialized as nn.Linear(V, D) is.
        self.ctc_condition = (
            nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model).uniform_(
                -cfg.vocab_size ** -0.5, cfg.vocab_size ** -0.5))
            if cfg.self_condition_layer else None
        )

    def forward(
        self,
        feats: torch.Tensor,
        feat_lens: torch.Tensor,
        chunk_size: Optional[int] = None,
        left_chunks: int = -1,
        head: Optional[nn.Module] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """
        Args:
            feats: ``(B, T, F)`` normalized log-mel features. feat_lens: ``(B,)`` int64 frame
            counts. chunk_size: 0 for full context; > 0 each encoder frame attends to its chunk of
            that many frames and ``left_chunks`` chunks before it (< 0: all), as ``forward_chunk``
            encodes a stream; None: full context, except in training with ``dynamic_chunk``
            (``draw_chunk``). head: the CTC head, which a self-conditioned encoder
            (``self_condition_layer``) needs.
        Returns:
            ``(B, T', D)`` encoder states and ``(B,)`` their lengths (on CUDA T' is padded to a
            multiple of ``ALIGN``: read the states by their lengths).
        """
        x, lengths, _ = self.forward_tapped(feats, feat_lens, chunk_size, left_chunks, head=head)
        return x, lengths

    def forward_tapped(
        self,
        feats: torch.Tensor,
        feat_lens: torch.Tensor,
        chunk_size: Optional[int] = None,
        left_chunks: int = -1,
        tap: int = 0,
        head: Optional[nn.Module] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """``forward``, and the states after block ``tap`` (counted from 1; 0: None), which
        intermediate CTC scores (before a self-conditioning on that block adds to them)."""
        x, lengths = self.subsampling(feats, feat_lens)
        # (B, T', D), see ALIGN
        x = F.pad(x, (0, 0, 0, aligned_length(x.shape[1], x.device) - x.shape[1]))
        pad = pad_mask(lengths, x.shape[1])  # (B, T')
        rope = self.rotary(x.shape[1], x.device)
        if chunk_size is None and self.training and self.cfg.dynamic_chunk:
            chunk_size, left_chunks = self.draw_chunk(x.shape[1])
        allowed = _chunk_allowed(pad, chunk_size, left_chunks) if chunk_size else None
        checkpointed = self.gradient_checkpointing and self.training
        if self.time_reduce is not None and allowed is not None:
            raise ValueError("a time-reduced encoder encodes with full context only")
        condition = self.cfg.self_condition_layer
        if condition and head is None:
            raise ValueError("a self-conditioned encoder needs the CTC head: encode with "
                             "ASRModel.encode")
        # One loop over the blocks, cut where something happens after a block: the tap is read,
        # the CTC head's posteriors condition the states, the frames are halved (blocks after + 1
        # to until run at half the rate, self.reduced) or brought back to the full rate.
        after, until = self.reduced
        full = here = (pad, rope, allowed)
        skip = tapped = None  # skip: the states from before the halving, while halved
        start = 0
        for stop in sorted({tap, condition, after, until, len(self.blocks)} - {0}):
            x = run_layers(self.blocks[start:stop], x, *here, checkpointed=checkpointed)
            start = stop
            if stop == until:  # back to the full rate
                x, here, skip = self._recovered(x, skip), full, None
            if stop == tap:
                tapped = x if skip is None else self._recovered(x, skip)
            if stop == condition:
                posteriors = torch.softmax(head(x).float(), dim=-1)
                x = x + (posteriors @ self.ctc_condition.float()).to(x.dtype)
            if stop == after:  # halve
                skip = x
                x = self.time_reduce(x.masked_fill(pad.unsqueeze(-1), 0).transpose(1, 2))
                x = x.transpose(1, 2)
                here = (pad_mask((lengths + 1) // 2, x.shape[1]), self.rotary(x.shape[1], x.device),
                        None)
        return x, lengths, tapped

    @staticmethod
    def _recovered(x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return x.repeat_interleave(2, dim=1)[:, :skip.shape[1]] + skip

    def draw_chunk(self, frames: int) -> tuple[int, int]:
        """A training batch's ``(chunk_size, left_chunks)`` under ``dynamic_chunk``, for ``frames``
        encoder frames, from torch's default generator (the run's seed): full context ``(0, -1)``
        half the time, otherwise a chunk of 1 to ``max_chunk`` frames (uniform) with all chunks to
        its left
        (-1), or with ``dynamic_left_chunks`` 0 up to all of them (uniform)."""
        if torch.randint(2, ()) == 0:
            return 0, -1
        chunk = int(torch.randint(1, self.cfg.max_chunk + 1, ()))
        if not self.cfg.dynamic_left_chunks:
            return chunk, -1
        return chunk, int(torch.randint(max(frames - 1, 0) // chunk + 1, ()))

    def forward_chunk(self, feats: torch.Tensor, state: Optional[StreamState] = None,
                      left_frames: int = -1) -> tuple[torch.Tensor, StreamState]:
        """Encode one chunk of a stream (a model with ``causal_conv``).

        Args:
            feats: ``(B, W, F)`` normalized features, a window of ``feature_windows``: W =
                ``Conv2dSubsampling.window_frames(C)`` frames make C encoder frames; the next
                window starts ``4 * C`` frames later (B streams in step).
            state: what the chunks before left (None for the first chunk).
            left_frames: encoder frames of the past that later chunks may attend to, ``left_chunks *
                chunk_size`` (< 0: all of them); the attention caches keep no more.
        Returns:
            ``(B, C, D)`` encoder states, those ``forward(..., chunk_size=C, left_chunks=...)``
            gives for these frames, and the state for the next chunk.
        """
        if not self.cfg.causal_conv:
            raise ValueError(
                "chunk-by-chunk encoding needs a model with causal_conv (its convolutions "
                "would otherwise look ahead of the chunk)"
            )
        x, _ = self.subsampling(feats, torch.tensor([feats.shape[1]]))
        offset, C = (0 if state is None else state.offset), x.shape[1]
        cos, sin = self.rotary(offset + C, x.device)  # rows for positions 0 .. offset + C - 1
        rope = cos[offset:offset + C], sin[offset:offset + C]
        conv = (x.new_zeros(len(self.blocks), x.shape[0], self.cfg.conv_kernel - 1, x.shape[2])
                if state is None else state.conv_inputs)
        keys_values, conv_inputs = [], []
        for n, block in enumerate(self.blocks):
            past = None if state is None else state.keys_values[n]
            x, (k, v), c = block(x, None, rope, None, past, conv[n])
            if left_frames >= 0:
                first = max(0, k.shape[2] - left_frames)
                k, v = k[:, :, first:], v[:, :, first:]
            keys_values.append(torch.stack([k, v]))
            conv_inputs.append(c)
        return x, StreamState(offset + C, torch.stack(keys_values), torch.stack(conv_inputs))

    def forward_chunk_of_streams(
        self, feats: torch.Tensor, states: Sequence[Optional[StreamState]], left_frames: int = -1
    ) -> tuple[torch.Tensor, list[StreamState]]:
        """Encode one chunk of each of B streams in one batched forward: what ``forward_chunk``
        gives each row with its own state, though the streams are at different offsets with caches
        of different lengths (each row's rotary positions are its own; the keys and values of the
        past are padded before each row to the longest and the padding masked out; the convolution
        caches, all of one size, stacked).

        Args:
            feats: ``(B, W, F)`` normalized features, one window of ``feature_windows`` a stream,
                all of one length.
            states: each row's state, from ``forward_chunk`` or ``forward_chunk_of_streams``
                (None: its first chunk).
            left_frames: as ``forward_chunk``, for every row.
        Returns:
            ``(B, C, D)`` encoder states and each row's state for its next chunk.
        """
        if not self.cfg.causal_conv:
            raise ValueError(
                "chunk-by-chunk encoding needs a model with causal_conv (its convolutions "
                "would otherwise look ahead of the chunk)"
            )
        B = feats.shape[0]
        if len(states) != B:
            raise ValueError(f"{B} windows and {len(states)} states: one state a window")
        x, _ = self.subsampling(feats, torch.full((B,), feats.shape[1]))
        C, device = x.shape[1], x.device
        offsets = [0 if s is None else s.offset for s in states]
        lengths = [_cached_frames(s) for s in states]
        longest = max(lengths)
        cos, sin = self.rotary(max(offsets) + C, device)
        positions = (torch.tensor(offsets)[:, None] + torch.arange(C)).to(device)  # (B, C)
        rope_rows = cos[positions][:, None], sin[positions][:, None]  # (B, 1, C, D/H)
        N, K, D = len(self.blocks), self.cfg.conv_kernel - 1, self.cfg.d_model
        H = self.cfg.n_heads
        # every block's keys and values of the past, each row's right-aligned (just before its
        # chunk's); zeros in the padding (masked out, and finite: a masked value still meets a
        # zero weight)
        past = x.new_zeros(N, 2, B, H, longest, D // H)
        conv = x.new_zeros(N, B, K, D)
        for b, state in enumerate(states):
            if state is not None:
                past[:, :, b:b + 1, :, longest - lengths[b]:] = state.keys_values
                conv[:, b:b + 1] = state.conv_inputs
        allowed = None
        if min(lengths) < longest:
            pad = torch.tensor([longest - n for n in lengths])[:, None]
            seen = torch.arange(longest + C)[None, :] >= pad  # (B, P + C)
            allowed = seen[:, None, None, :].to(device)
        kvs, convs = [], []
        for n, block in enumerate(self.blocks):
            x, kv, c = block(x, None, rope_rows, allowed, past[n], conv[n])
            kvs.append(torch.stack(kv))
            convs.append(c)
        keys_values, conv = torch.stack(kvs), torch.stack(convs)  # (N, 2, B, H, P + C, D/H), ...
        out = []
        for b in range(B):
            first = longest - lengths[b]
            if left_frames >= 0:
                first = max(first, longest + C - left_frames)
            # copies: a row's state holds none of the batch's memory once the batch is gone
            out.append(StreamState(offsets[b] + C,
                                   keys_values[:, :, b:b + 1, :, first:].contiguous(),
                                   conv[:, b:b + 1].contiguous()))
        return x, out

    def forward_chunk_by_chunk(
        self, feats: torch.Tensor, chunk_size: int, left_chunks: int = -1
    ) -> torch.Tensor:
        """``(B, T, F)`` normalized features of whole utterances (no padding) -> ``(B, T', D)``,
        encoded chunk by chunk with ``forward_chunk`` as a stream would be."""
        left_frames = left_chunks * chunk_size if left_chunks >= 0 else -1
        state, outs = None, []
        for window in feature_windows(feats, chunk_size):
            out, state = self.forward_chunk(window, state, left_frames)
            outs.append(out)
        return (
            torch.cat(outs, dim=1) if outs else feats.new_zeros(feats.shape[0], 0, self.cfg.d_model)
        )
