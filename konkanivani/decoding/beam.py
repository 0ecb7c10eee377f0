"""The attention searches' beam state, the scorers that add to a hypothesis's score, and the one
weighted sum of those scores that every search ranks by.

A hypothesis's score is ``ScoreWeights.total``: ``weights[k] * scores[k]`` over its named scores,
as ESPnet's ``BeamSearch`` sums its scorers: the model's own (``attention``, the decoder's
log-probability, and ``ctc``, CTC's), then what fusion and hotwords add (``length``, tokens
emitted, ``lm``, the language model's log-probability, ``hotword``, the context bonus). Each search
names its weights (``Fusion.weights``) and hands its scores to that one sum: the attention searches
the next token's scores of each running hypothesis, CTC prefix beam search each prefix's scores,
attention rescoring each hypothesis's of the n-best.

An attention search (``search.attention_beam_search``: the attention decoder alone, or joint
CTC/attention decoding) runs N = B * K hypotheses, K for each of B utterances, as the rows of one
decoder batch. ``Beam`` holds what each row carries: its tokens, its score, the decoder's state and
each scorer's state; ``Beam.select`` makes the next step's hypotheses and reorders every state at
once.

A scorer is one named score of a hypothesis with a state per row, behind one interface:

- ``init(n)``: n empty hypotheses;
- ``score(ys, ...)``: the score of each next token after each hypothesis (``ys``: their tokens so
  far, ``(N, U)``, the first the start symbol), unweighted;
- ``select(rows, tokens)``: the hypotheses of the next step, row ``rows[i]`` extended by
  ``tokens[i]``. A row whose token is the end symbol is dead (the beam's padding; its score is
  -inf, so its state counts for nothing).

The language model (``LMScorer``, ``log P_LM(token | prefix)``) and the hotwords
(``HotwordScorer``, the context bonus of ``hotwords.ContextGraph``) score every token, ``(N, V)``:
full scorers. CTC prefix scoring (``CTCPrefixScorer``) runs its recursion over all the frames for
each token it scores, so it scores only the candidates a pre-beam chose (``score(ys,
candidates)``, ``(N, C)``), as ESPnet's partial scorers do. ``LMScorer`` also scores the language
model where the hypotheses are not rows of a beam: each prefix of a CTC prefix beam search
(``next_rows``), and each whole hypothesis that attention rescoring scores (``sentences``).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from ..data.tokenizer import BLANK_ID, SOS_EOS_ID
from ..model.decoder import DecoderState
from ..model.lm import LMState, TransformerLM
from ..model.masks import pad_mask
from .hotwords import ContextGraph, ContextState

__all__ = ["ACOUSTIC", "FUSION", "Beam", "CTCPrefixScorer", "HotwordScorer", "LMScorer",
           "NEG_INF", "ScoreWeights", "Scorer"]

NEG_INF = float("-inf")
# The scores a hypothesis sums, in the order they add: the model's own, then (summed apart, and
# added to them) what fusion and hotwords add.
ACOUSTIC = ("attention", "ctc")
FUSION = ("length", "lm", "hotword")

Score = TypeVar("Score", float, torch.Tensor)


@dataclass(frozen=True)
class ScoreWeights:
    """The weight of each named score in a hypothesis's total (see the module): ``attention`` and
    ``ctc`` (``1 - λ`` and ``λ`` in joint decoding and rescoring), ``length`` (the bonus ``B`` per
    token), ``lm`` (``W``) and ``hotword`` (the context bonus counts whole).

    Examples:
        >>> w = ScoreWeights(attention=0.7, ctc=0.3, length=0.5, lm=0.2)
        >>> round(w.total({"attention": -2.0, "ctc": -4.0, "length": 3, "lm": -5.0}), 6)
        -2.1
    """

    attention: float = 0.0
    ctc: float = 0.0
    length: float = 0.0
    lm: float = 0.0
    hotword: float = 1.0

    def __post_init__(self):
        # the names that count (weight not 0: it changes nothing, and 0 * -inf is nan), each part's
        object.__setattr__(self, "_counted", {part: tuple(
            (name, getattr(self, name)) for name in part if getattr(self, name))
            for part in (ACOUSTIC, FUSION)})

    def total(self, scores: Mapping[str, Score]) -> Score:
        """``weights[k] * scores[k]`` summed over the ``scores`` given: the ``ACOUSTIC`` ones, plus
        the ``FUSION`` ones summed apart (``part``); 0.0 if none counts."""
        acoustic, fusion = self.part(ACOUSTIC, scores), self.part(FUSION, scores)
        if fusion is None:
            return 0.0 if acoustic is None else acoustic
        return fusion if acoustic is None else acoustic + fusion

    def part(self, names: tuple[str, ...], scores: Mapping[str, Score]) -> Score | None:
        """The weighted sum of the ``scores`` of ``names`` (``ACOUSTIC`` or ``FUSION``), in their
        order, leaving out a score whose weight is 0; None if none is left."""
        out = None
        for name, weight in self._counted[names]:
            if name in scores:
                term = weight * scores[name]
                out = term if out is None else out + term
        return out


class Scorer(Protocol):
    """A named score of an attention search's hypotheses with a state per running hypothesis (see
    the module); ``CTCPrefixScorer.score`` takes the pre-beam's candidates besides ``ys``."""

    name: str  # its weight's in ``ScoreWeights``

    def init(self, n: int) -> None:
        """Start ``n`` empty hypotheses."""

    def score(self, ys: torch.Tensor) -> torch.Tensor:
        """``(N, V)``: the score of each next token after each hypothesis of tokens ``ys``."""

    def select(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Keep the states of the next step's hypotheses: row ``rows[i]`` extended by
        ``tokens[i]``."""


class LMScorer:
    """Shallow fusion's language model score: ``log P_LM(token | prefix)``, the LM stepped along
    with the decoder (its rows reordered with the decoder's)."""

    name = "lm"

    def __init__(self, lm: TransformerLM):
        self.lm = lm
        self.state: LMState | None = None

    def init(self, n: int) -> None:
        self.state = self.lm.init_state()  # its first step decides the rows

    def score(self, ys: torch.Tensor) -> torch.Tensor:
        log_probs, self.state = self.lm.step(ys[:, -1], self.state)
        return log_probs

    def select(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        self.state = self.state.select(rows)

    def next_rows(self, prefixes: list[list[int]]) -> list[list[float]]:
        """The score of each next token after each of ``prefixes``, each scored from its start, in
        one LM call."""
        return self.lm.next_log_probs(prefixes).tolist()

    def sentences(self, hypotheses: list[list[int]], device: torch.device) -> list[float]:
        """``log P_LM(hypothesis + end)`` of each whole hypothesis."""
        return self.lm.sentence_log_probs(hypotheses, device).tolist()


class HotwordScorer:
    """The hotwords' context bonus of every extension: each row's node of the hotwords' automaton
    and its bonus for every token (``ContextGraph.row``, one tensor per node, made once)."""

    name = "hotword"

    def __init__(self, graph: ContextGraph, vocab_size: int, device: torch.device):
        self.graph, self.vocab_size, self.device = graph, vocab_size, device
        self.states: list[ContextState] = []
        self.cache: dict[ContextState, torch.Tensor] = {}

    def init(self, n: int) -> None:
        self.states = [self.graph.root] * n

    def score(self, ys: torch.Tensor) -> torch.Tensor:
        """``(N, V)``: the bonus of each token (the end symbol's: ``ContextGraph.final``)."""
        for state in self.states:
            if state not in self.cache:
                self.cache[state] = torch.tensor(
                    self.graph.row(state, self.vocab_size, SOS_EOS_ID), device=self.device
                )
        return torch.stack([self.cache[state] for state in self.states])

    def select(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        states, graph = self.states, self.graph
        self.states = [graph.root if token == SOS_EOS_ID else graph.step(states[row], token)[0]
                       for row, token in zip(rows.tolist(), tokens.tolist())]


class CTCPrefixScorer:
    """Batched CTC prefix scores: the change in log P_ctc(prefix), the probability that the CTC
    head's output starts with the prefix, when a hypothesis is extended by a candidate token (by
    the end symbol: the whole sequence's probability), with the prefix recursion of hybrid
    CTC/attention decoding.

    ``log_probs`` ``(B, T, V)`` are the utterances' CTC log-probabilities and ``lengths`` ``(B,)``
    their frames; ``init(n)`` gives each utterance n / B rows, its CTC output padded past its length
    with blank = 0 and every other token = -inf, so that a prefix's probability stays constant
    beyond its utterance's end."""

    def __init__(self, log_probs: torch.Tensor, lengths: torch.Tensor):
        self.log_probs, self.lengths = log_probs, lengths

    def init(self, n: int) -> None:
        per_utterance = n // len(self.lengths)
        x = self.log_probs.repeat_interleave(per_utterance, dim=0).float().clone()
        past_end = pad_mask(self.lengths.repeat_interleave(per_utterance), x.shape[1])  # (N, T)
        x.masked_fill_(past_end[..., None], NEG_INF)
        x[..., BLANK_ID].masked_fill_(past_end, 0.0)
        self.x = x.transpose(0, 1).contiguous()  # (T, N, V)
        # r (T, N, 2): log P(prefix ends at frame t in its last token / in a blank); psi (N,):
        # log P(prefix)
        self.r = self.x.new_full((*self.x.shape[:2], 2), NEG_INF)
        self.r[:, :, 1] = self.x[:, :, BLANK_ID].cumsum(0)
        self.psi = self.x.new_zeros(n)
        # the last ``score``'s candidates, and their prefixes' psi and r, for ``select``
        self.scored: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def score(self, ys: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """``(N, C)``: the change in log P_ctc of each hypothesis extended by each of its
        ``candidates`` ``(N, C)``."""
        T, N, _ = self.x.shape
        last, r_prev = ys[:, -1], self.r
        xs = self.x.gather(2, candidates[None].expand(T, N, -1))  # (T, N, C)
        r_sum = torch.logaddexp(r_prev[..., 0], r_prev[..., 1])  # (T, N)
        # A repeated token needs a blank between: from the prefix ending in blank only.
        phi = torch.where(
            candidates[None] == last[None, :, None], r_prev[..., 1, None], r_sum[..., None]
        )
        r = xs.new_full((T, N, candidates.shape[1], 2), NEG_INF)
        if ys.shape[1] == 1:  # the empty prefix
            r[0, :, :, 0] = xs[0]
        blank = self.x[:, :, BLANK_ID, None]  # (T, N, 1)
        for t in range(1, T):
            r[t, ..., 0] = torch.logaddexp(r[t - 1, ..., 0], phi[t - 1]) + xs[t]
            r[t, ..., 1] = torch.logaddexp(r[t - 1, ..., 0], r[t - 1, ..., 1]) + blank[t]
        psi = torch.logsumexp(torch.cat([r[:1, ..., 0], phi[:-1] + xs[1:]], dim=0), dim=0)  # (N, C)
        psi = torch.where(candidates == SOS_EOS_ID, r_sum[-1, :, None], psi)
        self.scored = (candidates, psi, r)
        return psi - self.psi[:, None]

    def select(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        candidates, psi, r = self.scored
        # the column of each live row's token among its candidates (they are distinct)
        col = (candidates[rows] == tokens[:, None]).int().argmax(1)
        self.psi, self.r = psi[rows, col], r[:, rows, col]


class Beam:
    """The running hypotheses of an attention search, ``beam_size`` rows for each of ``batch``
    utterances: their tokens ``ys`` ``(N, U)`` (from the start symbol), their scores ``(N,)`` (the
    first row of each utterance live at the start, the others -inf), the decoder's state, the
    ``scorers`` of every token and in joint decoding the ``ctc`` prefix scorer, each started with N
    rows."""

    def __init__(self, batch: int, beam_size: int, decoder: DecoderState,
                 scorers: Sequence[Scorer], ctc: CTCPrefixScorer | None, device: torch.device):
        n = batch * beam_size
        self.ys = torch.full((n, 1), SOS_EOS_ID, dtype=torch.long, device=device)
        scores = torch.full((batch, beam_size), NEG_INF, device=device)
        scores[:, 0] = 0.0
        self.scores = scores.view(n)
        self.decoder, self.scorers, self.ctc = decoder, list(scorers), ctc
        for scorer in self._all():
            scorer.init(n)

    def _all(self) -> list[Scorer | CTCPrefixScorer]:
        return self.scorers if self.ctc is None else [*self.scorers, self.ctc]

    def select(self, rows: torch.Tensor, tokens: torch.Tensor, scores: torch.Tensor) -> None:
        """The next step's hypotheses: row ``rows[i]`` extended by ``tokens[i]``, scoring
        ``scores[i]``; every state reordered (the decoder's, each scorer's)."""
        self.ys = torch.cat([self.ys[rows], tokens[:, None]], dim=1)
        self.scores = scores
        self.decoder = self.decoder.select(rows)
        for scorer in self._all():
            scorer.select(rows, tokens)
