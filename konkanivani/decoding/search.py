"""Decoding: greedy CTC, CTC prefix beam search, attention beam search, joint CTC/attention beam
search and attention rescoring of the CTC n-best.

The attention and joint searches run all utterances of a batch and all their hypotheses as one
decoder batch (``beam.Beam``). Joint decoding adds, for each extension of a hypothesis, the change
in its CTC prefix score (the probability that the CTC head's output starts with that prefix),
computed with the prefix recursion of hybrid CTC/attention decoding over the candidate tokens only
(``beam.CTCPrefixScorer``).

Scores are natural-log probabilities, and every method ranks by one weighted sum of them
(``beam.ScoreWeights``; ``Fusion.weights`` names a search's weights). With ``ctc_weight`` λ a
hypothesis scores ``λ * log P_ctc(prefix) + (1 - λ) * log P_att(prefix)``; finished hypotheses are
ranked by that score divided by their length (tokens + end symbol) when ``length_norm`` is on.

Shallow fusion (``Fusion``) adds to every method but greedy an external language model over the
same token ids: ``W * log P_LM(token | prefix)`` per token, ``W * log P_LM(end | prefix)`` when a
hypothesis ends (``beam.LMScorer``), and a bonus ``B`` per emitted token, which offsets the LM's
pull towards short outputs. With fusion, the attention and joint searches rank finished hypotheses
by their fused score, not divided by the length: the bonus takes that role. With ``W = B = 0`` each
method returns what it returns without fusion, scores included.

Hotwords (``hotword_graph``, a ``hotwords.ContextGraph``) add a context bonus to CTC prefix beam
search, attention rescoring and joint decoding: each token that spells a hotword earns its boost,
taken back when the word is not completed (the module ``hotwords``). CTC prefix beam search prunes
and ranks its prefixes by the score with the bonus; attention rescoring rescores that search's
n-best and keeps each hypothesis's bonus (``Hypothesis.hotword_bonus``) at full weight, so that a
hotword the CTC search found is not lost to the decoder, which never saw it; joint decoding adds
the bonus to each extension, in its pre-beam too (``beam.HotwordScorer``). The attention search
alone is not biased: nothing holds it to the audio. Without a graph, or with a boost of 0
(``ContextGraph.active`` False), each method returns what it returns without hotwords.

Long input: ``decode_encoded``'s attention searches stop a hypothesis at a length the CTC head
supports (``ctc_length_bound``, a margin over its greedy hypothesis), and it decodes an utterance
longer than ``settings.LONG_INPUT_SECONDS`` with CTC prefix beam search (``LONG_INPUT_METHOD``) when
an attention-based method is asked for: their cost grows with the square of the length (each of the
U steps of joint decoding runs the CTC prefix recursion over all T' frames), and the decoder never
saw such input in training. CTC prefix beam search and greedy decoding grow about linearly.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from ..data.frames import frames_of
from ..data.tokenizer import BLANK_ID, SOS_EOS_ID
from ..model.lm import TransformerLM
from ..model.masks import pad_mask
from .beam import FUSION, NEG_INF, Beam, CTCPrefixScorer, HotwordScorer, LMScorer, ScoreWeights
from .hotwords import ContextGraph, ContextState
from .settings import (
    FUSED_METHODS,
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
    "rescore_nbest",
    "attention_scores",
    "CTCBestPath",
    "CTCPrefixBeam",
    "ctc_greedy",
    "ctc_length_bound",
    "ctc_prefix_beam_search",
    "decode_encoded",
    "method_for",
]

ATTENTION_METHODS = ("attention", "joint", "rescore")  # those that run the attention decoder
# An utterance over settings.LONG_INPUT_SECONDS asked of an ATTENTION_METHODS method is decoded
# with this.
LONG_INPUT_METHOD = "beam"  # CTC prefix beam search: linear in the length, takes the same fusion
# The attention searches stop a hypothesis at MAX_LEN_RATIO * (tokens of the greedy CTC hypothesis)
# + MAX_LEN_EXTRA tokens: a decoder that never emits the end symbol stops there, not at the
# encoder length.
MAX_LEN_RATIO = 1.5
MAX_LEN_EXTRA = 10


@dataclass
class Hypothesis:
    tokens: list[int]
    score: float  # the method's total log score (not length-normalized), fusion terms included
    # CTC prefix beam search: the encoder frame where each token peaked
    frames: list[int] | None = None
    # CTC prefix beam search and attention rescoring: the unweighted scores ``score`` is the
    # weighted sum of (``ScoreWeights.total``)
    scores: dict[str, float] = field(default_factory=dict)

    @property
    def hotword_bonus(self) -> float:
        """The hotwords' context bonus that ``score`` includes."""
        return self.scores.get("hotword", 0.0)


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

    def scorer(self) -> LMScorer | None:
        """The LM's score (``log P_LM``) as a scorer; None without an LM."""
        return None if self.lm is None else LMScorer(self.lm)

    def weights(self, attention: float = 0.0, ctc: float = 0.0) -> ScoreWeights:
        """The weights of a search whose model scores weigh ``attention`` and ``ctc``: the length
        bonus ``B``, the LM's ``W`` (0 without an LM), the hotwords' bonus whole."""
        return ScoreWeights(attention, ctc, float(self.length_bonus),
                            self.lm_weight if self.lm is not None else 0.0)


def _emitted(vocab_size: int, device: torch.device) -> torch.Tensor:
    """The ``length`` score of each next token, ``(V,)``: 1 (a token emitted), 0 for the end
    symbol."""
    length = torch.ones(vocab_size, device=device)
    length[SOS_EOS_ID] = 0.0
    return length


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


class _PrefixState:
    """A prefix in a CTC prefix beam and all the search keeps of it, so that pruning the beam is
    keeping these: its node (the one ``_Prefix`` of its tokens, holding the frame where its last
    token peaked), log P(prefix) over the frames so far ending in a blank and in its last token
    (``blank``, ``nonblank``; ``next``: the same, summed over the frame being searched), its
    LM log-probability (``lm``, with an LM), its node of the hotwords' automaton and its context
    bonus so far (``hotword``, ``earned``), the weighted sum of its ``FUSION`` scores (``fused``,
    made once: they change only as it grows), and with an LM ``log P_LM(token | prefix)`` per
    token (``lm_next``, once it is in the beam)."""

    __slots__ = ("node", "blank", "nonblank", "next", "lm", "hotword", "earned", "fused",
                 "lm_next")

    def __init__(self, node: _Prefix, weights: ScoreWeights, lm: float = 0.0,
                 hotword: ContextState | None = None, earned: float = 0.0,
                 blank: float = NEG_INF):
        self.node, self.lm, self.hotword, self.earned = node, lm, hotword, earned
        self.fused = weights.part(FUSION, self.scores()) or 0.0
        self.blank, self.nonblank = blank, NEG_INF
        self.next = [NEG_INF, NEG_INF]
        self.lm_next: list[float] | None = None

    def scores(self, ctc: float | None = None) -> dict[str, float]:
        """Its unweighted scores, with CTC's ``ctc`` where given."""
        out = {"length": self.node.length, "lm": self.lm, "hotword": self.earned}
        return out if ctc is None else {"ctc": ctc, **out}

    def score(self, probs: Sequence[float]) -> float:
        """The score it is pruned and ranked by, with log-probabilities ``probs``: the weighted
        sum of its scores (``ScoreWeights.total``, CTC's weight 1), its ``FUSION`` part made
        once."""
        return _logaddexp(*probs) + self.fused


@torch.inference_mode()
def ctc_prefix_beam_search(log_probs: torch.Tensor, length: int, beam_size: int,
                           fusion: Fusion | None = None,
                           hotword_graph: ContextGraph | None = None) -> list[Hypothesis]:
    """Prefix beam search over one utterance's CTC output ``(T', V)``; returns up to ``beam_size``
    prefixes, best first, scored by log P(prefix) summed over all alignments (plus, with
    ``fusion``, ``W * log P_LM(prefix + end) + B * len(prefix)``, and with ``hotword_graph`` the
    hotwords' bonus). ``CTCPrefixBeam`` over all the frames at once."""
    search = CTCPrefixBeam(beam_size, fusion, hotword_graph)
    search.advance(log_probs[:length])
    return search.hypotheses()


class CTCBestPath:
    """The best path (``ctc_greedy``) over the frames as they come, with ``CTCPrefixBeam``'s
    ``advance``/``hypotheses``: a stream's ``greedy``. Each frame's likeliest output, repeats
    merged and blanks dropped, so a stream's greedy text is a whole file's, and sherpa-onnx's
    greedy search's over the same frames. Its one hypothesis scores the path's log-probability;
    each token's frame is where it peaked in its run of frames (counted from the first frame).

    Examples:
        >>> lp = torch.log_softmax(torch.tensor([[0., 5, 0], [0, 5, 0], [5, 0, 0], [0, 5, 0]]), -1)
        >>> search = CTCBestPath()
        >>> search.advance(lp[:3]); search.advance(lp[3:]); best = search.hypotheses()[0]
        >>> best.tokens, best.frames
        ([1, 1], [0, 3])
    """

    def __init__(self):
        self.tokens: list[int] = []
        self.token_frames: list[int] = []
        self.score = 0.0
        self.last, self.peak = BLANK_ID, NEG_INF  # the last frame's output; its token's peak
        self.frames = 0  # frames seen so far

    def advance(self, log_probs: torch.Tensor) -> None:
        """Take the next ``(T, V)`` frames (T may be 0)."""
        lp = log_probs.float().cpu()
        best = lp.argmax(-1)
        values = lp.gather(-1, best[:, None])[:, 0]
        for t, (tok, value) in enumerate(zip(best.tolist(), values.tolist())):
            self.score += value
            if tok != BLANK_ID and tok != self.last:
                self.tokens.append(tok)
                self.token_frames.append(self.frames + t)
                self.peak = value
            elif tok != BLANK_ID and value > self.peak:
                self.token_frames[-1], self.peak = self.frames + t, value
            self.last = tok
        self.frames += lp.shape[0]

    def hypotheses(self, final: bool = True) -> list[Hypothesis]:
        """The best path so far, alone (``final`` is ``CTCPrefixBeam``'s, and changes nothing)."""
        return [Hypothesis(list(self.tokens), self.score, list(self.token_frames),
                           {"ctc": self.score})]


class CTCPrefixBeam:
    """CTC prefix beam search that advances over the frames as they come: ``advance`` takes the next
    frames' log-probabilities ``(T, V)``, ``hypotheses`` returns the current n-best at any point
    (a streaming recognizer's partial result, or the final one), best first.

    Each frame considers only its ``beam_size`` most likely tokens. With fusion, prefixes are pruned
    by CTC + ``W * log P_LM(prefix) + B * len(prefix)``, and the end symbol's LM term ranks the
    final list; the LM scores each surviving prefix from its start once (``LMScorer.next_rows``).
    Without an LM, the cost is linear in the length (``_Prefix``). Each hypothesis carries, for
    timestamps, the frame at which each of its tokens was likeliest (counted from the stream's first
    frame).

    With a ``hotword_graph``, each prefix carries its node of the hotwords' automaton and its
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
                 hotword_graph: ContextGraph | None = None):
        self.beam_size, self.fusion = beam_size, fusion or Fusion()
        self.lm, self.weights = self.fusion.scorer(), self.fusion.weights(ctc=1.0)
        # a graph that adds nothing (a boost of 0) is none: the search is the same
        self.hotword_graph = (
            hotword_graph if hotword_graph is not None and hotword_graph.active else None
        )
        self.settled = max(1, beam_size // 2)  # see the class
        root = None if self.hotword_graph is None else self.hotword_graph.root
        empty = _PrefixState(_Prefix(), self.weights, hotword=root, blank=0.0)
        self.beam: dict[_Prefix, _PrefixState] = {empty.node: empty}  # each key its state's node
        self.frames = 0  # frames seen so far

    def advance(self, log_probs: torch.Tensor) -> None:
        """Take the next ``(T, V)`` frames (T may be 0)."""
        lp = log_probs.float().cpu()
        if lp.shape[0] == 0:
            return
        top_vals, top_ids = lp.topk(min(self.beam_size, lp.shape[-1]), dim=-1)
        blank_lp = lp[:, BLANK_ID].tolist()
        for t in range(lp.shape[0]):
            self._score_lm()
            frame = self.frames + t
            nxt: dict[_Prefix, _PrefixState] = {}  # the prefixes after this frame
            for prefix, state in self.beam.items():
                total = _logaddexp(state.blank, state.nonblank)
                _accumulate(nxt, state, 0, total + blank_lp[t])
                for value, tok in zip(top_vals[t].tolist(), top_ids[t].tolist()):
                    if tok == BLANK_ID:
                        continue
                    longer = self._extended(state, tok, frame, value, nxt)
                    if tok == prefix.token:
                        _peak(prefix, frame, value)
                        # repeat merged into the same token
                        _accumulate(nxt, state, 1, state.nonblank + value)
                        # a new token, after a blank
                        _accumulate(nxt, longer, 1, state.blank + value)
                    else:
                        _accumulate(nxt, longer, 1, total + value)
            self.beam = self._pruned(nxt)
        self.frames += lp.shape[0]

    def _extended(self, state: _PrefixState, tok: int, frame: int, value: float,
                  nxt: dict[_Prefix, _PrefixState]) -> _PrefixState:
        """The state of ``state``'s prefix extended by ``tok`` (log-prob ``value`` at ``frame``):
        the one this frame or the beam holds, its peak updated, else a new one."""
        node = _Prefix(state.node, tok, frame, value)
        known = nxt.get(node) or self.beam.get(node)
        if known is not None:
            _peak(known.node, frame, value)
            return known
        lm = state.lm + state.lm_next[tok] if self.lm is not None else 0.0
        if self.hotword_graph is None:
            return _PrefixState(node, self.weights, lm)
        hotword, bonus = self.hotword_graph.step(state.hotword, tok)
        return _PrefixState(node, self.weights, lm, hotword, state.earned + bonus)

    def _pruned(self, nxt: dict[_Prefix, _PrefixState]) -> dict[_Prefix, _PrefixState]:
        """The beam after a frame: the ``beam_size`` best prefixes of ``nxt`` (with hotwords, and
        the ``settled`` best by the score they would end with), their log-probabilities this
        frame's."""
        ranked = sorted(nxt.values(), key=lambda s: s.score(s.next), reverse=True)
        beam = {s.node: s for s in ranked[:self.beam_size]}
        if self.hotword_graph is not None:
            # and the best by the score they would end with: a hotword only begun cannot push
            # the likeliest plain readings out of the beam
            for s in heapq.nlargest(self.settled, nxt.values(),
                                    key=lambda s: s.score(s.next) - s.hotword.pending):
                beam.setdefault(s.node, s)
        for s in beam.values():
            s.blank, s.nonblank = s.next
        return beam

    def _score_lm(self) -> None:
        """``lm_next`` of each prefix of the beam that has none yet, in one LM call."""
        new = [s for s in self.beam.values() if s.lm_next is None] if self.lm is not None else []
        if new:
            for s, row in zip(new, self.lm.next_rows([s.node.tokens() for s in new])):
                s.lm_next = row

    def hypotheses(self, final: bool = True) -> list[Hypothesis]:
        """The n-best so far, best first; with fusion each ends with the LM's end symbol. With
        hotwords, ``final`` takes back the bonus of a hotword a prefix has only begun (the n-best
        of a whole input or segment); a partial result (``final`` False) keeps it."""
        self._score_lm()
        hyps = []
        for prefix, s in self.beam.items():
            scores = s.scores(_logaddexp(s.blank, s.nonblank))
            if self.lm is not None:
                scores["lm"] += s.lm_next[SOS_EOS_ID]
            if self.hotword_graph is not None and final:
                scores["hotword"] += self.hotword_graph.final(s.hotword)
            hyps.append(Hypothesis(prefix.tokens(), self.weights.total(scores), prefix.frames(),
                                   scores))
        # stable: unchanged order without fusion
        return sorted(hyps, key=lambda h: h.score, reverse=True)


def _peak(node: _Prefix, frame: int, value: float) -> None:
    if value > node.peak:
        node.frame, node.peak = frame, value


def _accumulate(nxt: dict[_Prefix, _PrefixState], state: _PrefixState, which: int,
                value: float) -> None:
    """Add ``value`` to ``state``'s log-probability this frame ending in a blank (``which`` 0) or in
    its last token (1), and ``state`` to ``nxt``."""
    if state.node not in nxt:
        nxt[state.node] = state
        state.next = [NEG_INF, NEG_INF]
    state.next[which] = _logaddexp(state.next[which], value)


def _logaddexp(a: float, b: float) -> float:
    if a == NEG_INF:
        return b
    if b == NEG_INF:
        return a
    hi, lo = (a, b) if a > b else (b, a)
    return hi + math.log1p(math.exp(lo - hi))


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
    hotword_graph: ContextGraph | None = None,
) -> list[Hypothesis]:
    """Beam search of the attention decoder, batched over utterances and hypotheses; with
    ``ctc_weight`` > 0 it is joint CTC/attention decoding; with ``fusion`` an LM (stepped along
    with the decoder, its rows reordered with the decoder's) and a length bonus add to each
    extension, and with ``hotword_graph`` the hotwords' bonus (ending a hypothesis takes back a
    hotword it has only begun). Returns the best hypothesis per utterance.

    Each step takes the top ``2 * beam_size`` extensions per utterance; those that end go to the
    finished list, the best ``beam_size`` others continue. An utterance stops once it has
    ``beam_size`` finished hypotheses, or at ``max_len`` tokens: one number, one per utterance
    (``decode_encoded`` gives ``ctc_length_bound``), or by default its encoder length, the most CTC
    can align.
    """
    B, K, vocab_size = enc.shape[0], beam_size, model.cfg.vocab_size
    fusion = fusion or Fusion()
    limit = _limit(max_len, enc_lens).repeat_interleave(K)  # per hypothesis
    # the scorers of every token, in the order their terms add: the LM's, the hotwords'
    scorers = [s for s in (fusion.scorer(), _hotword_scorer(hotword_graph, vocab_size, enc.device))
               if s is not None]
    ctc = CTCPrefixScorer(model.ctc_log_probs(enc), enc_lens) if ctc_weight > 0 else None
    beam = Beam(B, K, model.decoder.init_state(enc, enc_lens), scorers, ctc, enc.device)
    weights = fusion.weights(attention=1 - ctc_weight, ctc=ctc_weight)
    length = _emitted(vocab_size, enc.device)
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool)
    n_cand = min(K * 2, vocab_size - 1)
    for step in range(int(limit.max()) + 1):
        ext, cand = _extensions(model, beam, weights, length, step >= limit, n_cand)
        # A prefix CTC cannot produce scores -inf; its extensions give -inf - -inf = nan.
        total = beam.scores[:, None] + ext
        total = total.masked_fill(total.isnan(), NEG_INF).view(B, K * n_cand)
        top_scores, top_idx = total.topk(min(2 * K, total.shape[1]), dim=-1)  # (B, 2K)
        # row in the N hypotheses
        src = top_idx // n_cand + torch.arange(B, device=enc.device)[:, None] * K
        tok = cand.view(B, K * n_cand).gather(1, top_idx)
        ends, kept = _looked_at(top_scores, tok, K)
        _finish(finished, beam.ys, top_scores, src, ends & ~done[:, None].to(ends.device))
        rows, tokens, scores = _continuing(top_scores, src, tok, kept, K, finished, done)
        if bool(done.all()):
            break
        beam.select(rows, tokens, scores)

    # With fusion the length bonus does length normalization's work (dividing by the length would
    # all but cancel it): finished hypotheses are ranked by their fused score.
    return _best_finished(finished, normalize=length_norm and not fusion.active)


def _extensions(model, beam: Beam, weights: ScoreWeights, length: torch.Tensor,
                at_limit: torch.Tensor, n_cand: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder stepped, and the ``n_cand`` best extensions of each running hypothesis
    ``(N, C)``: the weighted sum of their scores (the decoder's log-probability, in joint decoding
    the change in the CTC prefix score, the ``length`` score of each token ``(V,)``, each scorer's)
    and their tokens. Hypotheses ``at_limit`` can only end."""
    logits, beam.decoder = model.decoder.step(beam.ys[:, -1], beam.decoder)
    att = _attention_log_probs(logits, at_limit)  # (N, V)
    scores = {"attention": att, "length": length.expand_as(att),
              **{s.name: s.score(beam.ys) for s in beam.scorers}}  # (N, V) each
    if beam.ctc is None:
        return weights.total(scores).topk(n_cand, dim=-1)
    # Pre-beam on the decoder's log-probability (weight 1) and the scorers', then CTC prefix
    # scores for those candidates only.
    cand = replace(weights, attention=1.0, length=0.0).total(scores).topk(n_cand, dim=-1).indices
    scores = {name: score.gather(1, cand) for name, score in scores.items()}  # (N, C) each
    scores["ctc"] = beam.ctc.score(beam.ys, cand)
    return weights.total(scores), cand


def _hotword_scorer(graph: ContextGraph | None, vocab_size: int, device: torch.device
                    ) -> HotwordScorer | None:
    """The attention searches' hotword scorer; None without a graph or with one that adds nothing
    (a boost of 0)."""
    return None if graph is None or not graph.active else HotwordScorer(graph, vocab_size, device)


def _limit(max_len: int | torch.Tensor | None, enc_lens: torch.Tensor) -> torch.Tensor:
    """``attention_beam_search``'s length limit per utterance ``(B,)``."""
    if max_len is None:
        return enc_lens.clone()
    if isinstance(max_len, torch.Tensor):
        return max_len.to(enc_lens.device, enc_lens.dtype)
    return torch.full_like(enc_lens, max_len)


def _attention_log_probs(logits: torch.Tensor, at_limit: torch.Tensor) -> torch.Tensor:
    """The decoder's log-probabilities of the next token: never blank, and only the end symbol in
    the rows ``at_limit`` (hypotheses at their length limit)."""
    att = F.log_softmax(logits.float(), dim=-1)
    att[:, BLANK_ID] = NEG_INF
    only_end = torch.arange(att.shape[1], device=att.device) == SOS_EOS_ID
    att[at_limit] = torch.where(only_end, att[at_limit], NEG_INF)
    return att


def _best_finished(finished: list[list[Hypothesis]], normalize: bool) -> list[Hypothesis]:
    """The best finished hypothesis of each utterance, by score per token (counting the end symbol)
    with ``normalize``, else by score; an utterance with none gets an empty one scored -inf."""
    norm = (lambda h: h.score / (len(h.tokens) + 1)) if normalize else (lambda h: h.score)
    return [max(pool or [Hypothesis([], NEG_INF)], key=norm) for pool in finished]


def _looked_at(top_scores: torch.Tensor, tok: torch.Tensor, K: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Of each utterance's best extensions ``(B, 2K)``, best first, those a step looks at: each
    live one (scored above -inf) until ``K`` have continued. Returns which of them end (extended
    by the end symbol) and which continue, ``(B, 2K)`` each."""
    live = top_scores != NEG_INF
    ends = tok == SOS_EOS_ID
    goes_on = live & ~ends
    before = goes_on.cumsum(1) - goes_on.long()  # the continuing ones better than each
    seen = live & (before < K)
    return seen & ends, seen & ~ends


def _finish(finished: list[list[Hypothesis]], ys: torch.Tensor, top_scores: torch.Tensor,
            src: torch.Tensor, ends: torch.Tensor) -> None:
    """The extensions ``ends`` ``(B, 2K)`` marks (each hypothesis of rows ``src`` and tokens ``ys``
    extended by the end symbol, scoring ``top_scores``) to their utterances' ``finished``
    hypotheses, best first."""
    b, j = ends.nonzero(as_tuple=True)
    if len(b):
        for utt, tokens, score in zip(b.tolist(), ys[src[b, j], 1:].tolist(),
                                      top_scores[b, j].tolist()):
            finished[utt].append(Hypothesis(tokens, score))


def _continuing(top_scores: torch.Tensor, src: torch.Tensor, tok: torch.Tensor,
                kept: torch.Tensor, K: int, finished: list[list[Hypothesis]],
                done: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The next step's hypotheses ``(N,)`` each (rows, tokens, scores): the extensions ``kept``
    marks, best first, K for each utterance, padded with dead ones (the utterance's first row, the
    end symbol, -inf); and ``done`` updated: an utterance with K finished hypotheses, or none
    continuing, is done, and its hypotheses score -inf."""
    B = len(finished)
    order = torch.sort((~kept).int(), dim=1, stable=True).indices[:, :K]  # those kept first
    live = kept.gather(1, order)
    first_rows = torch.arange(B, device=src.device)[:, None] * K
    rows = torch.where(live, src.gather(1, order), first_rows)
    tokens = torch.where(live, tok.gather(1, order), SOS_EOS_ID)
    scores = torch.where(live, top_scores.gather(1, order), NEG_INF)
    done |= torch.tensor([len(pool) >= K for pool in finished]) | ~live[:, 0].cpu()
    scores = scores.masked_fill(done[:, None].to(scores.device), NEG_INF)
    return rows.view(-1), tokens.view(-1), scores.view(-1)


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


def _rescored(model, enc: torch.Tensor, enc_lens: torch.Tensor, nbest: list[Hypothesis],
              ctc_weight: float, fusion: Fusion) -> list[Hypothesis]:
    """Each hypothesis of CTC prefix beam search n-bests (``nbest``, each over its own encoder rows
    ``enc[i]``, ``enc_lens[i]``) rescored: ``λ * log P_ctc + (1 - λ) * log P_att`` plus the LM's
    weighted sentence score and the length bonus, and its hotwords' bonus at full weight (the
    search's scores, ``Hypothesis.scores``, with the decoder's and the LM's)."""
    tokens = [h.tokens for h in nbest]
    att = attention_scores(model, enc, enc_lens, tokens).tolist()
    lm = fusion.scorer()
    lm_scores = [0.0] * len(nbest) if lm is None else lm.sentences(tokens, enc.device)
    weights = fusion.weights(attention=1 - ctc_weight, ctc=ctc_weight)
    out = []
    for h, a, lm_score in zip(nbest, att, lm_scores):
        scores = {"ctc": h.scores["ctc"], "hotword": h.hotword_bonus, "attention": a,
                  "length": len(h.tokens), "lm": lm_score}
        out.append(Hypothesis(h.tokens, weights.total(scores), scores=scores))
    return out


@torch.inference_mode()
def attention_rescoring(model, enc: torch.Tensor, enc_lens: torch.Tensor,
                        beam_size: int = DecodingConfig.beam_size,
                        ctc_weight: float = DecodingConfig.ctc_weight,
                        fusion: Fusion | None = None,
                        hotword_graph: ContextGraph | None = None) -> list[Hypothesis]:
    """CTC prefix beam search, then each n-best hypothesis rescored with the attention decoder:
    ``λ * log P_ctc + (1 - λ) * log P_att`` (+ ``W * log P_LM(hyp + end) + B * len(hyp)`` with
    ``fusion``; the n-best itself comes from the CTC search without the LM). With
    ``hotword_graph`` the n-best comes from the search biased towards the hotwords, and each
    hypothesis keeps its context bonus at full weight. Returns the best per utterance (the first
    of equals), in one decoder call.
    """
    log_probs = model.ctc_log_probs(enc)
    nbests = [
        ctc_prefix_beam_search(log_probs[b], int(enc_lens[b]), beam_size,
                               hotword_graph=hotword_graph)
        for b in range(enc.shape[0])
    ]
    rows = torch.tensor([b for b, nbest in enumerate(nbests) for _ in nbest], device=enc.device)
    flat = [h for nbest in nbests for h in nbest]
    best: list[Hypothesis | None] = [None] * len(nbests)
    for b, cand in zip(rows.tolist(), _rescored(model, enc[rows], enc_lens[rows], flat,
                                                ctc_weight, fusion or Fusion())):
        if best[b] is None or cand.score > best[b].score:
            best[b] = cand
    return best


@torch.inference_mode()
def rescore_nbest(model, enc: torch.Tensor, nbest: list[Hypothesis], ctc_weight: float,
                  fusion: Fusion | None = None) -> Hypothesis:
    """The hypothesis of one utterance's n-best (a CTC prefix beam search's, best first) that
    attention rescoring chooses over its encoder frames ``enc`` ``(T, D)``, rescored as
    ``attention_rescoring`` rescores: a stream's segment, at its end."""
    n = len(nbest)
    return max(_rescored(model, enc[None].expand(n, -1, -1),
                         torch.full((n,), len(enc), device=enc.device), nbest, ctc_weight,
                         fusion or Fusion()),
               key=lambda h: h.score)


def method_for(method: str, frames: int, long_input_seconds: float = LONG_INPUT_SECONDS) -> str:
    """The method an utterance of ``frames`` feature frames is decoded with when ``method`` is asked
    for: ``LONG_INPUT_METHOD`` for an attention-based one above ``long_input_seconds``, else
    ``method``."""
    if method in ATTENTION_METHODS and frames > frames_of(long_input_seconds):
        return LONG_INPUT_METHOD
    return method


@torch.inference_mode()
def decode_encoded(model, enc: torch.Tensor, enc_lens: torch.Tensor, feat_lens: torch.Tensor,
                   decoding: DecodingConfig, fusion: Fusion | None = None,
                   hotword_graph: ContextGraph | None = None) -> list[list[int]]:
    """Token ids per utterance from the encoder's output ``(enc, enc_lens)`` of features of lengths
    ``feat_lens``, with the ``method``, ``beam_size`` and ``ctc_weight`` of resolved settings
    ``decoding`` (``DecodingConfig.resolved``, whose ``check`` refuses a method that does not take
    the fusion or the hotwords asked for), and the recognizer's ``fusion`` and ``hotword_graph``
    made from them: for a caller that keeps the encoder's output (the recognizer aligns words to
    its CTC log-probabilities).

    An utterance longer than ``LONG_INPUT_SECONDS`` asked of an attention-based method is decoded
    with ``LONG_INPUT_METHOD`` (``method_for``); the caller says so, as it knows the files. The
    attention searches stop a hypothesis at ``ctc_length_bound`` tokens."""
    methods = [method_for(decoding.method, n) for n in feat_lens.tolist()]
    if len(set(methods)) == 1:
        return _decode_encoded(model, enc, enc_lens, methods[0], decoding, fusion, hotword_graph)
    out: list[list[int]] = [[] for _ in methods]
    for each in dict.fromkeys(methods):  # each group cut to its own longest utterance
        rows = [b for b, m in enumerate(methods) if m == each]
        lens = enc_lens[rows]
        ids = _decode_encoded(model, enc[rows, : int(lens.max())], lens, each, decoding, fusion,
                              hotword_graph)
        for b, h in zip(rows, ids):
            out[b] = h
    return out


def _decode_encoded(model, enc: torch.Tensor, enc_lens: torch.Tensor, method: str,
                    decoding: DecodingConfig, fusion: Fusion | None,
                    hotword_graph: ContextGraph | None) -> list[list[int]]:
    """``decode_encoded`` of utterances that all decode with ``method``."""
    beam_size, ctc_weight = decoding.beam_size, decoding.ctc_weight
    if method == "greedy":
        return ctc_greedy(model.ctc_log_probs(enc), enc_lens)
    if method == "beam":
        log_probs = model.ctc_log_probs(enc)
        return [ctc_prefix_beam_search(log_probs[b], int(enc_lens[b]), beam_size, fusion,
                                       hotword_graph)[0].tokens
                for b in range(enc.shape[0])]
    if method == "rescore":
        return [h.tokens for h in attention_rescoring(model, enc, enc_lens, beam_size, ctc_weight,
                                                      fusion, hotword_graph)]
    weight = ctc_weight if method == "joint" else 0.0
    bound = ctc_length_bound(model.ctc_log_probs(enc), enc_lens)
    return [
        h.tokens
        for h in attention_beam_search(
            model, enc, enc_lens, beam_size, weight, max_len=bound, fusion=fusion,
            hotword_graph=hotword_graph,
        )
    ]
