"""A causal Transformer language model over the ASR model's own token ids, for shallow fusion.

The LM is trained on text alone (``konkanivani-train-lm``) with the ASR checkpoint's tokenizer, so
its vocabulary is the recognizer's: token 0 (the CTC blank) and 1 (``<unk>``) are ordinary ids it
never or rarely sees, and 2 (``<sos/eos>``) starts every sentence as input and ends it as target.

Its layers are the decoder's without cross-attention: pre-norm self-attention with rotary
positions (no length limit) and the same key/value cache, so beam search extends each hypothesis
by one token per step instead of recomputing its prefix.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import CheckpointError, LanguageModel, load_checkpoint
from ..config import FROM_TOKENIZER, flag_help
from ..data.tokenizer import SOS_EOS_ID, Tokenizer
from .conformer import Dropout, FeedForward, KVCache, LayerNorm, MultiHeadAttention, RotaryEmbedding
from .masks import causal_mask, pad_mask

__all__ = ["LMConfig", "LMState", "TransformerLM", "check_same_vocabulary", "load_lm"]


@dataclass
class LMConfig:
    """Dimensions of the LM; ``vocab_size`` comes from the tokenizer."""

    vocab_size: int = field(default=0, metadata=FROM_TOKENIZER)
    d_model: int = field(default=256, metadata=flag_help("model width"))
    n_heads: int = field(default=4, metadata=flag_help("attention heads (of even width)"))
    ffn_dim: int = field(default=0, metadata=flag_help("feed-forward width (0: 4 x d_model)"))
    layers: int = field(default=4, metadata=flag_help("Transformer layers"))
    dropout: float = field(default=0.1, metadata=flag_help("dropout probability"))

    def __post_init__(self):
        self.ffn_dim = self.ffn_dim or 4 * self.d_model

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class LMState(NamedTuple):
    """Self-attention keys and values of the tokens fed so far, one row per hypothesis."""

    kv: KVCache

    def select(self, rows: torch.Tensor) -> LMState:
        """Keep (reorder, copy) the hypotheses ``rows``, as beam search does with the decoder's
        state."""
        return LMState({m: (k[rows], v[rows]) for m, (k, v) in self.kv.items()})


class _Layer(nn.Module):
    """Pre-norm causal self-attention and feed-forward: a decoder layer without cross-attention."""

    def __init__(self, d_model: int, n_heads: int, ffn_dim: int, dropout: float):
        super().__init__()
        self.norm = LayerNorm(d_model)
        self.attn = MultiHeadAttention(d_model, n_heads, 0.0)
        self.ffn = FeedForward(d_model, ffn_dim, dropout)
        self.dropout = Dropout(dropout)

    def forward(
        self,
        x: torch.Tensor,
        allowed: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.norm(x), None, allowed, rope, cache))
        return x + self.ffn(x)


class TransformerLM(nn.Module):
    """Token prefixes (starting with ``<sos/eos>``) -> next-token logits."""

    def __init__(self, cfg: LMConfig):
        super().__init__()
        if cfg.d_model % cfg.n_heads or (cfg.d_model // cfg.n_heads) % 2:
            raise ValueError(
                f"d_model {cfg.d_model} must split into {cfg.n_heads} heads of even width"
            )
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.rotary = RotaryEmbedding(cfg.d_model // cfg.n_heads)
        self.layers = nn.ModuleList(_Layer(cfg.d_model, cfg.n_heads, cfg.ffn_dim, cfg.dropout)
                                    for _ in range(cfg.layers))
        self.final_norm = LayerNorm(cfg.d_model)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``(N, U)`` input ids -> ``(N, U, V)`` logits. Position i sees positions <= i only, so
        right padding never reaches a real position and needs no mask."""
        U = tokens.shape[1]
        x = self.embed(tokens) * math.sqrt(self.cfg.d_model)
        allowed, rope = causal_mask(U, tokens.device), self.rotary(U, tokens.device)
        for layer in self.layers:
            x = layer(x, allowed, rope)
        return self.output(self.final_norm(x))

    @staticmethod
    def _inputs(
        sentences: list[list[int]], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``<sos/eos>`` + each sentence, right-padded ``(N, U)``, and the real lengths ``(N,)``."""
        lens = torch.tensor([len(s) + 1 for s in sentences], device=device)
        ids = torch.full(
            (len(sentences), int(lens.max())), SOS_EOS_ID, dtype=torch.long, device=device
        )
        for i, s in enumerate(sentences):
            if s:
                ids[i, 1:len(s) + 1] = torch.tensor(s, device=device)
        return ids, lens

    def loss(self, sentences: list[list[int]], device: torch.device) -> tuple[torch.Tensor, int]:
        """Summed negative log-likelihood of the sentences, each followed by ``<sos/eos>``, and the
        number of tokens predicted (the end symbols included)."""
        log_p = self.sentence_log_probs(sentences, device)
        return -log_p.sum(), sum(len(s) + 1 for s in sentences)

    def sentence_log_probs(
        self, sentences: list[list[int]], device: torch.device | None = None
    ) -> torch.Tensor:
        """log P(sentence + ``<sos/eos>``) per sentence, ``(N,)``: what shallow fusion adds, at
        weight W,
        to a finished hypothesis."""
        device = device or next(self.parameters()).device
        ids, lens = self._inputs(sentences, device)
        target = torch.roll(ids, -1, dims=1)
        target[torch.arange(len(sentences), device=device), lens - 1] = SOS_EOS_ID  # the end symbol
        log_p = F.log_softmax(self(ids).float(), dim=-1).gather(2, target[..., None]).squeeze(-1)
        return log_p.masked_fill(pad_mask(lens, ids.shape[1]), 0.0).sum(1)

    def next_log_probs(self, prefixes: list[list[int]]) -> torch.Tensor:
        """log P(next token | prefix) over the vocabulary, ``(N, V)``, for prefixes of any lengths,
        each recomputed from its start (CTC prefix beam search, whose prefixes come and go)."""
        ids, lens = self._inputs(prefixes, next(self.parameters()).device)
        logits = self(ids)[torch.arange(len(prefixes), device=ids.device), lens - 1]
        return F.log_softmax(logits.float(), dim=-1)

    # ---- incremental scoring: one new token per hypothesis and step ----------------------------

    def init_state(self) -> LMState:
        """The state before the first token; the first ``step`` decides how many rows it has."""
        return LMState({})

    def step(self, tokens: torch.Tensor, state: LMState) -> tuple[torch.Tensor, LMState]:
        """log P(next token) ``(N, V)`` after appending ``tokens`` ``(N,)`` to each hypothesis, and
        the
        new state (the caller's is left as it was). The same numbers as ``forward`` on the prefix.
        """
        kv = dict(state.kv)
        position = next(iter(kv.values()))[0].shape[2] if kv else 0
        rope = self.rotary(position + 1, tokens.device)
        x = self.embed(tokens)[:, None] * math.sqrt(self.cfg.d_model)
        for layer in self.layers:
            x = layer(x, None, rope, kv)
        return F.log_softmax(self.output(self.final_norm(x))[:, 0].float(), dim=-1), LMState(kv)


def load_lm(
    path: str | Path, device: str | torch.device = "cpu"
) -> tuple[TransformerLM, Tokenizer]:
    """The LM of a ``konkanivani-train-lm`` checkpoint, in eval mode, and its tokenizer;
    ``CheckpointError`` in one line for any other file."""
    state = load_checkpoint(path)
    try:
        saved = LanguageModel.of(state, path)
        lm = TransformerLM(LMConfig(**saved.lm_config))
        lm.load_state_dict(saved.weights)
        tokenizer = Tokenizer(saved.tokenizer)
    except CheckpointError:  # not a language model's: said as it is
        raise
    except (KeyError, TypeError, RuntimeError, ValueError) as e:
        raise CheckpointError(
            f"{path}: the checkpoint does not hold a usable language model "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else e})"
        ) from e
    return lm.to(device).eval(), tokenizer


def check_same_vocabulary(lm_tokenizer: Tokenizer, lm_path: str | Path, asr_tokenizer: Tokenizer,
                          asr_path: str | Path) -> None:
    """Fusion adds LM and ASR scores id by id, so the two must mean the same piece by each id;
    ``CheckpointError`` naming both files otherwise."""
    lm_pieces = lm_tokenizer.pieces(range(lm_tokenizer.vocab_size))
    asr_pieces = asr_tokenizer.pieces(range(asr_tokenizer.vocab_size))
    if lm_pieces != asr_pieces:
        first = next((i for i, (a, b) in enumerate(zip(lm_pieces, asr_pieces)) if a != b),
                     min(len(lm_pieces), len(asr_pieces)))
        raise CheckpointError(
            f"language model {lm_path} was trained with another tokenizer than {asr_path} "
            f"({len(lm_pieces)} vs {len(asr_pieces)} pieces, first difference at id {first}); "
            "train it with konkanivani-train-lm --tokenizer on that ASR checkpoint"
        )
