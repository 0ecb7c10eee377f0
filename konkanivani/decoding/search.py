"""Decoding: greedy CTC, CTC prefix beam search, attention beam search, joint CTC/attention beam
search and attention rescoring of the CTC n-best.

The attention and joint searches run all utterances of a batch and all their hypotheses as one
decoder batch. Joint decoding adds, for each extension of a hypothesis, the change in its CTC
prefix score (the probability that the CTC head's output starts with that prefix), computed with
the prefix recursion of hybrid CTC/attention decoding over the candidate tokens only.

Scores are natural-log probabilities. With ``ctc_weight`` λ a hypothesis scores
``λ * log P_ctc(prefix) + (1 - λ) * log P_att(prefix)``; finished hypotheses are ranked by
that score divided by their length (tokens + end symbol) when ``length_norm`` is on.

Shallow fusion (``Fusion``) adds to every method but greedy an external language model over the
same token ids: ``W * log P_LM(token | prefix)`` per token, ``W * log P_LM(end | prefix)`` when a
hypothesis ends, and a bonus ``B`` per emitted token, which offsets the LM's pull towards short
outputs. With fusion, the attention and joint searches rank finished hypotheses by their fused
score, not divided by the length: the bonus takes that role. With ``W = B = 0`` each method returns
what it returns without fusion, scores included.

Hotwords (``context``, a ``hotwords.ContextGraph``) add a context bonus to CTC prefix beam search,
attention rescoring and joint decoding: each token that spells a hotword earns its boost, taken back
when the word is not completed (the module ``hotwords``). CTC prefix beam search prunes and ranks
its prefixes by the score with the bonus; attention rescoring rescores that search's n-best and
keeps each hypothesis's bonus (``Hypothesis.context``) at full weight, so that a hotword the CTC
search found is not lost to the decoder, which never saw it; joint decoding adds the bonus to each
extension, in its pre-beam too. The attention search alone is not biased: nothing holds it to the
audio. Without a context, or with a boost of 0 (``ContextGraph.active`` False), each method
returns what it returns without hotwords.

Long input: ``decode_batch``'s attention searches stop a hypothesis at a length the CTC head
supports (``ctc_length_bound``, a margin over its greedy hypothesis), and it decodes an utterance
longer than ``LONG_INPUT_SECONDS`` with CTC prefix beam search (``LONG_INPUT_METHOD``) when an
attention-based method is asked for: their cost grows with the square of the length (each of the
U steps of joint decoding runs the CTC prefix recursion over all T' frames), and the decoder never
saw such input in training. CTC prefix beam search and greedy decoding grow about linearly.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..data.frames import frames_of
from ..data.tokenizer import BLANK_ID, SOS_EOS_ID
from ..model.lm import TransformerLM
from ..model.masks import pad_mask
from .hotwords import ContextGraph, ContextState
from .settings import (
    FUSED_METHODS,
    HOTWORD_METHODS,
    LONG_INPUT_SECONDS,
    METHODS,
    DecodingConfig,
)

__all__ = [
    "ATTENTION_METHODS",
    "LONG_INPUT_METHOD",
    "LONG_INPUT_SECONDS",
    "METHODS",
    "FUSED_METHODS",
    "Fusion",
    "Hypothesis",
    "attention_beam_search",
    "attention_rescoring",
    "attention_scores",
    "CTCPrefixBeam",
    "ctc_greedy",
    "ctc_length_bound",
    "ctc_prefix_beam_search",
    "decode_batch",
    "decode_encoded",
    "method_for",
]

ATTENTION_METHODS = ("attention", "joint", "rescore")  # those that run the attention decoder
# An utterance over config.LONG_INPUT_SECONDS asked of an ATTENTION_METHODS method is decoded
# with this.
LONG_INPUT_METHOD = "beam"  # CTC prefix beam search: linear in the length, takes the same fusion
# The attention searches stop a hypothesis at MAX_LEN_RATIO * (tokens of the greedy CTC hypothesis)
# + MAX_LEN_EXTRA tokens: a decoder that never emits the end symbol stops there, not at the
# encoder length.
MAX_LEN_RATIO = 1.5
MAX_LEN_EXTRA = 10
NEG_INF = float("-inf")


@dataclass
class Hypothesis:
    tokens: list[int]
    score: float  # the method's total log score (not length-normalized), fusion terms included
    # CTC prefix beam search: the encoder frame where each token peaked
    frames: list[int] | None = None
    # CTC prefix beam search: the hotwords' context bonus that ``score`` includes
    context: float = 0.0


@dataclass
class Fusion:
    """Shallow fusion settings: ``lm`` over the ASR model's token ids (the caller checks that the
    vocabularies agree, ``lm.check_same_vocabulary``), its weight ``W`` and the per-token bonus
    ``B``.
    The default adds nothing."""

    lm: TransformerLM | None = None
    lm_weight: float = 0.0
    length_bonus: float = 0.0

    @property
    def active(self) -> bool:
        """Whether it changes any score."""
        return (self.lm is not None and self.lm_weight != 0) or self.length_bonus != 0

    def token_bonus(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """``B`` for every token but the end symbol, ``(V,)``."""
        bonus = torch.full((vocab_size,), float(self.length_bonus), device=device)
        bonus[SOS_EOS_ID] = 0.0
        return bonus


@torch.inference_mode()
def ctc_greedy(log_probs: torch.Tensor, lengths: torch.Tensor) -> list[list[int]]:
    """Best path: argmax per frame, merge repeats, drop blanks.

    Args:
        log_probs: ``(B, T', V)``; lengths: ``(B,)``.
    Returns:
        B lists of token ids.
    """
    best = log_probs.argmax(dim=-1).cpu()  # (B, T')
    hyps = []
    for path, length in zip(best.tolist(), lengths.tolist()):
        out, prev = [], BLANK_ID
        for tok in path[:length]:
            if tok != prev and tok != BLANK_ID:
                out.append(tok)
            prev = tok
        hyps.append(out)
    return hyps


def ctc_length_bound(log_probs: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The most tokens an attention search may emit per utterance ``(B,)``: ``MAX_LEN_RATIO`` times
    the greedy CTC hypothesis's tokens plus ``MAX_LEN_EXTRA``, never more than the encoder length
    (the most CTC can align). Args as ``ctc_greedy``."""
    greedy = torch.tensor([len(h) for h in ctc_greedy(log_probs, lengths)], dtype=torch.long)
    bound = (greedy * MAX_LEN_RATIO).ceil().long() + MAX_LEN_EXTRA
    return torch.minimum(lengths.cpu().long(), bound).to(lengths.device)


class _Prefix:
    """A CTC prefix as a linked list from its last token back, equal to any prefix of the same
    tokens. Extending one, and hashing it, costs the same at any length; tuples of tokens are
    copied and hashed whole, which made prefix beam search grow with the square of the length
    (20 min of audio: 142 s, 300 s: 9 s on the tiny model)."""

    __slots__ = ("parent", "token", "length", "_hash", "frame", "peak")

    def __init__(self, parent: _Prefix | None = None, token: int | None = None, frame: int = -1,
                 peak: float = NEG_INF):
        self.parent, self.token = parent, token
        # the frame where its last token was likeliest, and that log-prob
        self.frame, self.peak = frame, peak
        self.length = 0 if parent is None else parent.length + 1
        self._hash = hash(()) if parent is None else hash((parent._hash, token))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        a, b = self, other
        while a is not b:  # equal prefixes usually share all but their last few tokens
            if (
                not isinstance(b, _Prefix)
                or a._hash != b._hash
                or a.length != b.length
                or a.token != b.token
            ):
                return False
            a, b = a.parent, b.parent
        return True

    def tokens(self) -> list[int]:
        out, node = [], self
        while node.parent is not None:
            out.append(node.token)
            node = node.parent
        return out[::-1]

    def frames(self) -> list[int]:
        out, node = [], self
        while node.parent is not None:
            out.append(node.frame)
            node = node.parent
        return out[::-1]


@torch.inference_mode()
def ctc_prefix_beam_search(log_probs: torch.Tensor, length: int, beam_size: int,
                           fusion: Fusion | None = None,
                           context: ContextGraph | None = None) -> list[Hypothesis]:
    """Prefix beam search over one utterance's CTC output ``(T', V)``; returns up to ``beam_size``
    prefixes, best first, scored by log P(prefix) summed over all alignments (plus, with
    ``fusion``, ``W * log P_LM(prefix + end) + B * len(prefix)``, and with ``context`` the
    hotwords' bonus). ``CTCPrefixBeam`` over all the frames at once."""
    search = CTCPrefixBeam(beam_size, fusion, context)
    search.advance(log_probs[:length])
    return search.hypotheses()


class CTCPrefixBeam:
    """CTC prefix beam search that advances over the frames as they come: ``advance`` takes the next
    frames' log-probabilities ``(T, V)``, ``hypotheses`` returns the current n-best at any point
    (a streaming recognizer's partial result, or the final one), best first.

    Each frame considers only its ``beam_size`` most likely tokens. With fusion, prefixes are pruned
    by CTC + ``W * log P_LM(prefix) + B * len(prefix)``, and the end symbol's LM term ranks the
    final list; the LM scores each surviving prefix from its start once. Without an LM, the cost is
    linear in the length (``_Prefix``). Each hypothesis carries, for timestamps, the frame at which
    each of its tokens was likeliest (counted from the stream's first frame).

    With a ``context`` (hotwords), each prefix carries its node of the hotwords' automaton and its
    context bonus, in the score it is pruned and ranked by; the final n-best
    (``hypotheses(final=True)``) takes back the bonus of a hotword a prefix has only begun. The beam
    also keeps the ``beam_size // 2`` prefixes best by the score they would end with (the bonus of
    the hotwords they hold, not of one they have only begun), so that a begun hotword does not
    push the likeliest plain readings out (benchmarks/results/hotwords/README.md).

    Examples:
        >>> lp = torch.log_softmax(torch.tensor([[0., 5, 0], [5, 0, 0], [0, 0, 5]]), -1)
        >>> search = CTCPrefixBeam(beam_size=3)
        >>> search.advance(lp[:2]); search.hypotheses()[0].tokens
        [1]
        >>> search.advance(lp[2:]); best = search.hypotheses()[0]; best.tokens, best.frames
        ([1, 2], [0, 2])
    """

    def __init__(self, beam_size: int, fusion: Fusion | None = None,
                 context: ContextGraph | None = None):
        self.beam_size, self.fusion = beam_size, fusion or Fusion()
        # a context that adds nothing (a boost of 0) is none: the search is the same
        self.context = context if context is not None and context.active else None
        self.settled = max(1, beam_size // 2)  # see the class
        empty = _Prefix()
        # prefix -> (log P ending in blank, log P ending in its last token)
        self.beams: dict[_Prefix, tuple[float, float]] = {empty: (0.0, NEG_INF)}
        self.extra: dict[_Prefix, float] = {empty: 0.0}  # prefix -> its fusion terms so far
        # prefix -> W * log P_LM(token | prefix) per token
        self.lm_next: dict[_Prefix, list[float]] = {}
        # the one node of each prefix, holding its peak
        self.nodes: dict[_Prefix, _Prefix] = {empty: empty}
        # prefix -> (its node in the hotwords' automaton, its context bonus so far)
        self.states: dict[_Prefix, tuple[ContextState, float]] = (
            {} if self.context is None else {empty: (self.context.root, 0.0)}
        )
        self.frames = 0  # frames seen so far

    def advance(self, log_probs: torch.Tensor) -> None:
        """Take the next ``(T, V)`` frames (T may be 0)."""
        lp = log_probs.float().cpu()
        if lp.shape[0] == 0:
            return
        top_vals, top_ids = lp.topk(min(self.beam_size, lp.shape[-1]), dim=-1)
        blank_lp = lp[:, BLANK_ID].tolist()
        beams, extra, nodes, fusion = self.beams, self.extra, self.nodes, self.fusion
        context, states = self.context, self.states
        for t in range(lp.shape[0]):
            self.lm_next = lm_next = _weighted_lm_next(fusion, beams, self.lm_next)
            nxt: dict[_Prefix, list[float]] = {}
            for prefix, (pb, pnb) in beams.items():
                total = _logaddexp(pb, pnb)
                _accumulate(nxt, prefix, 0, total + blank_lp[t])
                for value, tok in zip(top_vals[t].tolist(), top_ids[t].tolist()):
                    if tok == BLANK_ID:
                        continue
                    longer = _Prefix(prefix, tok, self.frames + t, value)
                    if longer in nodes:
                        longer = nodes[longer]
                        _peak(longer, self.frames + t, value)
                    else:
                        nodes[longer] = longer
                        extra[longer] = (
                            extra[prefix]
                            + (lm_next[prefix][tok] if lm_next else 0.0)
                            + fusion.length_bonus
                        )
                        if context is not None:
                            state, earned = states[prefix]
                            state, bonus = context.step(state, tok)
                            states[longer] = (state, earned + bonus)
                            extra[longer] += bonus
                    if tok == prefix.token:
                        _peak(prefix, self.frames + t, value)
                        # repeat merged into the same token
                        _accumulate(nxt, prefix, 1, pnb + value)
                        _accumulate(nxt, longer, 1, pb + value)  # a new token, after a blank
                    else:
                        _accumulate(nxt, longer, 1, total + value)
            ranked = sorted(
                nxt.items(), key=lambda kv: _logaddexp(*kv[1]) + extra[kv[0]], reverse=True
            )
            beams = {prefix: (pb, pnb) for prefix, (pb, pnb) in ranked[:self.beam_size]}
            if context is not None:
                # and the best by the score they would end with: a hotword only begun cannot push
                # the likeliest plain readings out of the beam
                settled = heapq.nlargest(
                    self.settled, nxt.items(),
                    key=lambda kv: _logaddexp(*kv[1]) + extra[kv[0]] - states[kv[0]][0].pending)
                for prefix, (pb, pnb) in settled:
                    beams.setdefault(prefix, (pb, pnb))
            extra = {prefix: extra[prefix] for prefix in beams}
            nodes = {prefix: nodes[prefix] for prefix in beams}
            if context is not None:
                states = {prefix: states[prefix] for prefix in beams}
        self.beams, self.extra, self.nodes, self.states = beams, extra, nodes, states
        self.frames += lp.shape[0]

    def hypotheses(self, final: bool = True) -> list[Hypothesis]:
        """The n-best so far, best first; with fusion each ends with the LM's end symbol. With
        hotwords, ``final`` takes back the bonus of a hotword a prefix has only begun (the n-best
        of a whole input or segment); a partial result (``final`` False) keeps it."""
        self.lm_next = lm_next = _weighted_lm_next(self.fusion, self.beams, self.lm_next)
        hyps = [Hypothesis(prefix.tokens(), _logaddexp(pb, pnb) + self.extra[prefix]
                           + (lm_next[prefix][SOS_EOS_ID] if lm_next else 0.0), prefix.frames())
                for prefix, (pb, pnb) in self.beams.items()]
        if self.context is not None:
            for h, prefix in zip(hyps, self.beams):
                state, earned = self.states[prefix]
                taken = self.context.final(state) if final else 0.0
                h.score, h.context = h.score + taken, earned + taken
        # stable: unchanged order without fusion
        return sorted(hyps, key=lambda h: h.score, reverse=True)


def _peak(node: _Prefix, frame: int, value: float) -> None:
    if value > node.peak:
        node.frame, node.peak = frame, value


def _weighted_lm_next(fusion: Fusion, beams: dict[_Prefix, Any],
                      known: dict[_Prefix, list[float]]) -> dict[_Prefix, list[float]]:
    """``W * log P_LM(token | prefix)`` for each prefix of ``beams``: those of ``known`` reused, the
    others in one LM call. Empty without an LM."""
    if fusion.lm is None:
        return {}
    new = [p for p in beams if p not in known]
    out = {p: known[p] for p in beams if p in known}
    if new:
        rows = (fusion.lm_weight * fusion.lm.next_log_probs([p.tokens() for p in new])).tolist()
        out.update(zip(new, rows))
    return out


def _accumulate(beams: dict[_Prefix, list[float]], prefix: _Prefix, which: int,
                value: float) -> None:
    entry = beams.setdefault(prefix, [NEG_INF, NEG_INF])
    entry[which] = _logaddexp(entry[which], value)


def _logaddexp(a: float, b: float) -> float:
    if a == NEG_INF:
        return b
    if b == NEG_INF:
        return a
    hi, lo = (a, b) if a > b else (b, a)
    return hi + math.log1p(math.exp(lo - hi))


class _CTCPrefixScorer:
    """Batched CTC prefix scores for N running hypotheses and K candidate tokens each.

    ``x``: ``(N, T, V)`` CTC log-probabilities, padded past each length with blank = 0 and every
    other token = -inf, so that a prefix's probability stays constant beyond its utterance's end.
    """

    def __init__(self, log_probs: torch.Tensor, lengths: torch.Tensor):
        x = log_probs.float().clone()
        past_end = pad_mask(lengths, x.shape[1])  # (N, T)
        x.masked_fill_(past_end[..., None], NEG_INF)
        x[..., BLANK_ID].masked_fill_(past_end, 0.0)
        self.x = x.transpose(0, 1).contiguous()  # (T, N, V)

    def initial_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """State of the empty prefix: ``r`` ``(T, N, 2)`` = log P(prefix ends at t in a token / a
        blank)
        and ``psi`` ``(N,)`` = log P(prefix)."""
        T, N, _ = self.x.shape
        r = self.x.new_full((T, N, 2), NEG_INF)
        r[:, :, 1] = self.x[:, :, BLANK_ID].cumsum(0)
        return r, self.x.new_zeros(N)

    def score(self, r_prev: torch.Tensor, last: torch.Tensor, candidates: torch.Tensor,
              empty_prefix: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefix log-probabilities ``(N, K)`` of each hypothesis extended by each candidate, and
        the
        states ``(T, N, K, 2)`` of those extensions. The end symbol scores the whole sequence."""
        T, N, _ = self.x.shape
        xs = self.x.gather(2, candidates[None].expand(T, N, -1))  # (T, N, K)
        r_sum = torch.logaddexp(r_prev[..., 0], r_prev[..., 1])  # (T, N)
        # A repeated token needs a blank between: from the prefix ending in blank only.
        phi = torch.where(
            candidates[None] == last[None, :, None], r_prev[..., 1, None], r_sum[..., None]
        )
        r = xs.new_full((T, N, candidates.shape[1], 2), NEG_INF)
        if empty_prefix:
            r[0, :, :, 0] = xs[0]
        blank = self.x[:, :, BLANK_ID, None]  # (T, N, 1)
        for t in range(1, T):
            r[t, ..., 0] = torch.logaddexp(r[t - 1, ..., 0], phi[t - 1]) + xs[t]
            r[t, ..., 1] = torch.logaddexp(r[t - 1, ..., 0], r[t - 1, ..., 1]) + blank[t]
        psi = torch.logsumexp(torch.cat([r[:1, ..., 0], phi[:-1] + xs[1:]], dim=0), dim=0)  # (N, K)
        psi = torch.where(candidates == SOS_EOS_ID, r_sum[-1, :, None], psi)
        return psi, r


@torch.inference_mode()
def attention_beam_search(
    model,
    enc: torch.Tensor,
    enc_lens: torch.Tensor,
    beam_size: int = DecodingConfig.beam_size,
    ctc_weight: float = 0.0,
    length_norm: bool = True,
    max_len: int | torch.Tensor | None = None,
    fusion: Fusion | None = None,
    context: ContextGraph | None = None,
) -> list[Hypothesis]:
    """Beam search of the attention decoder, batched over utterances and hypotheses; with
    ``ctc_weight`` > 0 it is joint CTC/attention decoding; with ``fusion`` an LM (stepped along
    with the decoder, its rows reordered with the decoder's) and a length bonus add to each
    extension, and with ``context`` the hotwords' bonus (ending a hypothesis takes back a hotword
    it has only begun). Returns the best hypothesis per utterance.

    Each step takes the top ``2 * beam_size`` extensions per utterance; those that end go to the
    finished list, the best ``beam_size`` others continue. An utterance stops once it has
    ``beam_size`` finished hypotheses, or at ``max_len`` tokens: one number, one per utterance
    (``decode_batch`` gives ``ctc_length_bound``), or by default its encoder length, the most CTC
    can align.
    """
    B = enc.shape[0]
    K = beam_size
    N = B * K
    device = enc.device
    limit = _limit(max_len, enc_lens)
    ys = torch.full((N, 1), SOS_EOS_ID, dtype=torch.long, device=device)
    scores = torch.full((B, K), NEG_INF, device=device)
    scores[:, 0] = 0.0  # one live hypothesis per utterance at the start
    scores = scores.view(N)
    use_ctc = ctc_weight > 0
    if use_ctc:
        # One row per hypothesis: each utterance's CTC output, repeated for its K hypotheses.
        scorer = _CTCPrefixScorer(
            model.ctc_log_probs(enc).repeat_interleave(K, dim=0), enc_lens.repeat_interleave(K)
        )
        ctc_r, ctc_psi = scorer.initial_state()
    dec_state = model.decoder.init_state(enc, enc_lens)
    fusion = fusion or Fusion()
    lm_state = fusion.lm.init_state() if fusion.lm is not None else None
    # zeros without a bonus: nothing changes
    bonus = fusion.token_bonus(model.cfg.vocab_size, device)
    hotwords = (
        None
        if context is None or not context.active
        else _ContextRows(context, N, model.cfg.vocab_size, device)
    )
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool)
    n_cand = min(K * 2, model.cfg.vocab_size - 1)

    for step in range(int(limit.max()) + 1):
        logits, dec_state = model.decoder.step(ys[:, -1], dec_state)
        att = _attention_log_probs(logits, at_limit=step >= limit.repeat_interleave(K))  # (N, V)
        fused = bonus.expand_as(att)  # (N, V): the fusion terms of each extension
        if lm_state is not None:
            lm_lp, lm_state = fusion.lm.step(ys[:, -1], lm_state)
            fused = fused + fusion.lm_weight * lm_lp
        if hotwords is not None:
            fused = fused + hotwords.rows()
        if use_ctc:
            # Pre-beam on the attention (+ weighted LM, + context bonus) scores, then CTC prefix
            # scores for those candidates only.
            pre = (
                att if lm_state is None or fusion.lm_weight == 0 else att + fusion.lm_weight * lm_lp
            )
            if hotwords is not None:
                pre = pre + hotwords.rows()
            cand = pre.topk(n_cand, dim=-1).indices  # (N, C)
            psi, r_new = scorer.score(ctc_r, ys[:, -1], cand, empty_prefix=step == 0)
            ext = ((1 - ctc_weight) * att.gather(1, cand) + ctc_weight * (psi - ctc_psi[:, None])
                   + fused.gather(1, cand))
        else:
            ext, cand = (att + fused).topk(n_cand, dim=-1)
        # A prefix CTC cannot produce scores -inf; its extensions give -inf - -inf = nan.
        total = scores[:, None] + ext
        total = total.masked_fill(total.isnan(), NEG_INF).view(B, K * n_cand)
        top_scores, top_idx = total.topk(min(2 * K, total.shape[1]), dim=-1)  # (B, 2K)
        # row in the N hypotheses
        src = top_idx // n_cand + torch.arange(B, device=device)[:, None] * K
        tok = cand.view(B, K * n_cand).gather(1, top_idx)

        new_rows, new_scores, new_tok, new_col = _next_hypotheses(
            top_scores, top_idx, src, tok, ys, K, finished, done
        )
        if bool(done.all()):
            break
        rows = torch.tensor(new_rows, device=device)
        if hotwords is not None:
            hotwords.advance(new_rows, new_tok, new_scores)
        ys = torch.cat([ys[rows], torch.tensor(new_tok, device=device)[:, None]], dim=1)
        dec_state = dec_state.select(rows)
        if lm_state is not None:
            lm_state = lm_state.select(rows)
        scores = torch.tensor(new_scores, device=device)
        scores.view(B, K)[done.to(device)] = NEG_INF
        if use_ctc:
            col = torch.tensor(new_col, device=device) % n_cand
            ctc_psi = psi[rows, col]
            ctc_r = r_new[:, rows, col]

    # With fusion the length bonus does length normalization's work (dividing by the length would
    # all but cancel it): finished hypotheses are ranked by their fused score.
    return _best_finished(finished, normalize=length_norm and not fusion.active)


class _ContextRows:
    """The context bonus of every extension of the attention searches' N running hypotheses: each
    row's node of the hotwords' automaton and its bonus for every token (``ContextGraph.row``, one
    tensor per node, made once)."""

    def __init__(self, context: ContextGraph, n: int, vocab_size: int, device: torch.device):
        self.context, self.vocab_size, self.device = context, vocab_size, device
        self.states = [context.root] * n
        self.cache: dict[ContextState, torch.Tensor] = {}
        self._rows: torch.Tensor | None = None

    def rows(self) -> torch.Tensor:
        """``(N, V)``: the bonus of each token after each hypothesis (the end symbol's:
        ``ContextGraph.final``)."""
        if self._rows is None:
            for state in self.states:
                if state not in self.cache:
                    self.cache[state] = torch.tensor(
                        self.context.row(state, self.vocab_size, SOS_EOS_ID), device=self.device
                    )
            self._rows = torch.stack([self.cache[state] for state in self.states])
        return self._rows

    def advance(self, rows: list[int], tokens: list[int], scores: list[float]) -> None:
        """The hypotheses of the next step: row ``rows[i]`` extended by ``tokens[i]`` (none, a dead
        one, where ``scores[i]`` is -inf)."""
        self.states = [
            self.context.root if score == NEG_INF else self.context.step(self.states[row], tok)[0]
            for row, tok, score in zip(rows, tokens, scores)
        ]
        self._rows = None


def _limit(max_len: int | torch.Tensor | None, enc_lens: torch.Tensor) -> torch.Tensor:
    """``attention_beam_search``'s length limit per utterance ``(B,)``."""
    if max_len is None:
        return enc_lens.clone()
    if isinstance(max_len, torch.Tensor):
        return max_len.to(enc_lens.device, enc_lens.dtype)
    return torch.full_like(enc_lens, max_len)


def _attention_log_probs(logits: torch.Tensor, at_limit: torch.Tensor) -> torch.Tensor:
    """The decoder's log-probabilities of the next token: never blank, and only the end symbol in
    the
    rows `at_limit` (hypotheses at their length limit)."""
    att = F.log_softmax(logits.float(), dim=-1)
    att[:, BLANK_ID] = NEG_INF
    only_end = torch.arange(att.shape[1], device=att.device) == SOS_EOS_ID
    att[at_limit] = torch.where(only_end, att[at_limit], NEG_INF)
    return att


def _best_finished(finished: list[list[Hypothesis]], normalize: bool) -> list[Hypothesis]:
    """The best finished hypothesis of each utterance, by score per token (counting the end symbol)
    with `normalize`, else by score; an utterance with none gets an empty one scored -inf."""
    norm = (lambda h: h.score / (len(h.tokens) + 1)) if normalize else (lambda h: h.score)
    return [max(pool or [Hypothesis([], NEG_INF)], key=norm) for pool in finished]


def _next_hypotheses(
    top_scores: torch.Tensor,
    top_idx: torch.Tensor,
    src: torch.Tensor,
    tok: torch.Tensor,
    ys: torch.Tensor,
    K: int,
    finished: list[list[Hypothesis]],
    done: torch.Tensor,
) -> tuple[list[int], list[float], list[int], list[int]]:
    """One beam step's bookkeeping, per utterance: extensions by the end symbol go to ``finished``,
    the best ``K`` others continue (padded with dead hypotheses); an utterance with ``K`` finished
    hypotheses, or none left alive, is ``done``. Returns the continuing hypotheses' source rows,
    scores, new tokens and candidate columns."""
    new_rows, new_scores, new_tok, new_col = [], [], [], []
    top_scores_l, top_idx_l, src_l, tok_l = (
        top_scores.tolist(),
        top_idx.tolist(),
        src.tolist(),
        tok.tolist(),
    )
    for b in range(len(finished)):
        kept = 0
        for j in range(len(top_idx_l[b])):
            s = top_scores_l[b][j]
            if s == NEG_INF or kept == K:
                break
            row, t = src_l[b][j], tok_l[b][j]
            if t == SOS_EOS_ID:
                if not done[b]:
                    finished[b].append(Hypothesis(ys[row, 1:].tolist(), s))
                continue
            new_rows.append(row)
            new_scores.append(s)
            new_tok.append(t)
            new_col.append(top_idx_l[b][j])
            kept += 1
        for _ in range(K - kept):  # pad with dead hypotheses
            new_rows.append(b * K)
            new_scores.append(NEG_INF)
            new_tok.append(SOS_EOS_ID)
            new_col.append(0)
        if len(finished[b]) >= K or kept == 0:
            done[b] = True
    return new_rows, new_scores, new_tok, new_col


@torch.inference_mode()
def attention_scores(model, enc: torch.Tensor, enc_lens: torch.Tensor,
                     hyps: list[list[int]]) -> torch.Tensor:
    """Teacher-forced decoder log P(hyp + end symbol) for hypotheses of one encoder state each
    (``enc`` rows align with ``hyps``), in one decoder call. Returns ``(len(hyps),)``."""
    device = enc.device
    lens = torch.tensor([len(h) + 1 for h in hyps], device=device)
    U = int(lens.max())
    dec_in = torch.full((len(hyps), U), SOS_EOS_ID, dtype=torch.long, device=device)
    target = torch.full((len(hyps), U), SOS_EOS_ID, dtype=torch.long, device=device)
    for i, h in enumerate(hyps):
        if h:
            dec_in[i, 1:len(h) + 1] = torch.tensor(h, device=device)
            target[i, :len(h)] = torch.tensor(h, device=device)
    logp = F.log_softmax(model.decoder(dec_in, lens, enc, enc_lens).float(), dim=-1)
    picked = logp.gather(2, target[..., None]).squeeze(-1)  # (N, U)
    return picked.masked_fill(pad_mask(lens, U), 0.0).sum(1)


@torch.inference_mode()
def attention_rescoring(model, enc: torch.Tensor, enc_lens: torch.Tensor,
                        beam_size: int = DecodingConfig.beam_size,
                        ctc_weight: float = DecodingConfig.ctc_weight,
                        fusion: Fusion | None = None,
                        context: ContextGraph | None = None) -> list[Hypothesis]:
    """CTC prefix beam search, then each n-best hypothesis rescored with the attention decoder:
    ``λ * log P_ctc + (1 - λ) * log P_att`` (+ ``W * log P_LM(hyp + end) + B * len(hyp)`` with
    ``fusion``; the n-best itself comes from the CTC search without the LM). With ``context`` the
    n-best comes from the search biased towards the hotwords, and each hypothesis keeps its context
    bonus at full weight. Returns the best per utterance.
    """
    fusion = fusion or Fusion()
    log_probs = model.ctc_log_probs(enc)
    nbests = [
        ctc_prefix_beam_search(log_probs[b], int(enc_lens[b]), beam_size, context=context)
        for b in range(enc.shape[0])
    ]
    rows = torch.tensor([b for b, nbest in enumerate(nbests) for _ in nbest], device=enc.device)
    flat = [h for nbest in nbests for h in nbest]
    att = attention_scores(model, enc[rows], enc_lens[rows], [h.tokens for h in flat]).tolist()
    lm = (
        [0.0] * len(flat)
        if fusion.lm is None
        else (
            fusion.lm_weight * fusion.lm.sentence_log_probs([h.tokens for h in flat], enc.device)
        ).tolist()
    )
    best: list[Hypothesis | None] = [None] * len(nbests)
    for b, h, a, lm_score in zip(rows.tolist(), flat, att, lm):
        cand = Hypothesis(h.tokens, ctc_weight * (h.score - h.context) + (1 - ctc_weight) * a
                          + lm_score + fusion.length_bonus * len(h.tokens) + h.context,
                          context=h.context)
        if best[b] is None or cand.score > best[b].score:
            best[b] = cand
    return best


def method_for(method: str, frames: int, long_input_seconds: float = LONG_INPUT_SECONDS) -> str:
    """The method an utterance of ``frames`` feature frames is decoded with when ``method`` is asked
    for: ``LONG_INPUT_METHOD`` for an attention-based one above ``long_input_seconds``, else
    ``method``."""
    if method in ATTENTION_METHODS and frames > frames_of(long_input_seconds):
        return LONG_INPUT_METHOD
    return method


@torch.inference_mode()
def decode_batch(model, feats: torch.Tensor, feat_lens: torch.Tensor, method: str,
                 beam_size: int = DecodingConfig.beam_size,
                 ctc_weight: float = DecodingConfig.ctc_weight,
                 length_norm: bool = True, fusion: Fusion | None = None,
                 long_input_seconds: float = LONG_INPUT_SECONDS, chunk_size: int = 0,
                 left_chunks: int = -1, context: ContextGraph | None = None) -> list[list[int]]:
    """Token ids per utterance of a feature batch ``(B, T, F)`` with one of ``METHODS``, each but
    greedy with optional shallow ``fusion`` and hotwords' ``context``:

    - ``greedy``: best CTC path;
    - ``beam``: CTC prefix beam search;
    - ``attention``: attention-decoder beam search alone (no CTC);
    - ``joint``: attention beam search with CTC prefix scores weighted by ``ctc_weight``;
    - ``rescore``: the CTC n-best rescored by the attention decoder.

    An utterance longer than ``long_input_seconds`` asked of an attention-based method is decoded
    with ``LONG_INPUT_METHOD`` (``method_for``); the caller says so, as it knows the files. The
    attention searches stop a hypothesis at ``ctc_length_bound`` tokens. ``chunk_size`` > 0 encodes
    under the chunk mask (``left_chunks`` back, -1 all): the encoder frames a stream in chunks of
    that size computes, so a streaming model is scored as it streams.
    """
    enc, enc_lens = model.encode(feats, feat_lens, chunk_size=chunk_size, left_chunks=left_chunks)
    return decode_encoded(model, enc, enc_lens, feat_lens, method, beam_size, ctc_weight,
                          length_norm, fusion, long_input_seconds, context)


@torch.inference_mode()
def decode_encoded(model, enc: torch.Tensor, enc_lens: torch.Tensor, feat_lens: torch.Tensor,
                   method: str, beam_size: int = DecodingConfig.beam_size,
                   ctc_weight: float = DecodingConfig.ctc_weight, length_norm: bool = True,
                   fusion: Fusion | None = None, long_input_seconds: float = LONG_INPUT_SECONDS,
                   context: ContextGraph | None = None) -> list[list[int]]:
    """``decode_batch`` from the encoder's output ``(enc, enc_lens)`` of the features of lengths
    ``feat_lens`` on: for a caller that keeps the encoder's output (the recognizer aligns words to
    its CTC log-probabilities)."""
    if method not in METHODS:
        raise ValueError(f"unknown decoding method {method!r}; choose from {', '.join(METHODS)}")
    if (
        method not in FUSED_METHODS
        and fusion is not None
        and (fusion.lm is not None or fusion.length_bonus)
    ):
        raise ValueError(f"{method} decoding takes no language model or length bonus; choose from "
                         f"{', '.join(FUSED_METHODS)}")
    if method not in HOTWORD_METHODS and context is not None:
        raise ValueError(f"{method} decoding cannot be biased towards hotwords; choose from "
                         f"{', '.join(HOTWORD_METHODS)}")
    methods = [method_for(method, n, long_input_seconds) for n in feat_lens.tolist()]
    if len(set(methods)) == 1:
        return _decode_encoded(
            model, enc, enc_lens, methods[0], beam_size, ctc_weight, length_norm, fusion, context
        )
    out: list[list[int]] = [[] for _ in methods]
    for each in dict.fromkeys(methods):  # each group cut to its own longest utterance
        rows = [b for b, m in enumerate(methods) if m == each]
        lens = enc_lens[rows]
        ids = _decode_encoded(
            model,
            enc[rows, : int(lens.max())],
            lens,
            each,
            beam_size,
            ctc_weight,
            length_norm,
            fusion,
            context,
        )
        for b, h in zip(rows, ids):
            out[b] = h
    return out


def _decode_encoded(model, enc: torch.Tensor, enc_lens: torch.Tensor, method: str, beam_size: int,
                    ctc_weight: float, length_norm: bool, fusion: Fusion | None,
                    context: ContextGraph | None = None) -> list[list[int]]:
    """``decode_batch`` from the encoder states on, every utterance with ``method``."""
    if method == "greedy":
        return ctc_greedy(model.ctc_log_probs(enc), enc_lens)
    if method == "beam":
        log_probs = model.ctc_log_probs(enc)
        return [ctc_prefix_beam_search(log_probs[b], int(enc_lens[b]), beam_size, fusion,
                                       context)[0].tokens
                for b in range(enc.shape[0])]
    if method == "rescore":
        return [
            h.tokens
            for h in attention_rescoring(
                model, enc, enc_lens, beam_size, ctc_weight, fusion, context
            )
        ]
    weight = ctc_weight if method == "joint" else 0.0
    bound = ctc_length_bound(model.ctc_log_probs(enc), enc_lens)
    return [
        h.tokens
        for h in attention_beam_search(
            model, enc, enc_lens, beam_size, weight, length_norm, max_len=bound, fusion=fusion,
            context=context,
        )
    ]
