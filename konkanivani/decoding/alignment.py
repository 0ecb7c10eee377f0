"""Word times and confidences from a CTC alignment.

A hypothesis (whatever the search chose: greedy, beam, joint, rescored) is aligned to the CTC
log-probabilities of the forward pass that decoded it with ``torchaudio.functional.forced_align``
(the Viterbi path of the CTC topology that emits exactly those tokens), so every token gets the
encoder frames it is emitted on. Tokens make words as SentencePiece marks them: a word starts at a
piece that begins with "▁" (``WORD_START``); a "▁" alone (the space of a character tokenizer) is no
part of a word.

- **Times.** A CTC token is a spike a frame or two wide, a little after the sound starts, and the
  blank frames between spikes belong to no token. A word spans from the first frame of its first
  token to the end of the frame of its last token, 40 ms a frame (``FRAME_SECONDS``), and then moves
  by ``START_SHIFT`` and ``END_SHIFT``: constants measured on speech whose word boundaries are known
  (``benchmarks/word_times.py``, which chose them on the validation split and reports the test
  split). Words keep their order and do not overlap.
- **Probability.** Each token's posterior on its aligned frames (the mean over them of the
  probability the CTC head gives that token there, so in [0, 1]); a word's probability is the
  least of its tokens' (``word_probability``): a word with one doubtful letter is a doubtful word,
  which the mean of its letters hides. The benchmark measures how well each choice tells right
  words from wrong ones.

The cost is one ``forced_align`` per utterance on log-probabilities already computed (O(frames x
tokens) in C++), which is small beside the encoder.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torchaudio.functional as TAF

from ..data.frames import HOP_LENGTH, SAMPLE_RATE
from ..data.manifest import ctc_frames_needed
from ..data.tokenizer import BLANK_ID, Tokenizer
from ..model.conformer import Conv2dSubsampling

__all__ = [
    "END_SHIFT",
    "FRAME_SECONDS",
    "START_SHIFT",
    "WORD_START",
    "TokenSpan",
    "Word",
    "align_tokens",
    "align_words",
    "word_probability",
    "words_of_spans",
]

FRAME_SECONDS = Conv2dSubsampling.STRIDE * HOP_LENGTH / SAMPLE_RATE  # 0.04 s: one encoder frame
WORD_START = "\u2581"  # SentencePiece's mark of a word's first piece
# Seconds added to a word's aligned start and end (see the module): measured by
# benchmarks/word_times.py --calibrate on the demo corpus's validation split, 1,221 known
# boundaries: the median start error was -4 ms (left at 0), the median end error -20 ms, so a
# word's last token frame ends 20 ms before its sound does
# (benchmarks/results/word_times/README.md).
START_SHIFT = 0.0
END_SHIFT = 0.02


@dataclass
class Word:
    """A word of a result: its text, its start and end in seconds (from the start of the stream or
    file), and its probability in [0, 1] (``align_words``; None where it was not aligned: a
    stream's partial results time words by the frame where each token peaked)."""

    text: str
    start: float
    end: float
    probability: float | None = None


@dataclass
class TokenSpan:
    """A token's aligned encoder frames, ``start`` to ``end`` (exclusive), and its mean posterior
    there."""

    token: int
    start: int
    end: int
    probability: float


def align_tokens(log_probs: torch.Tensor, tokens: Sequence[int]) -> list[TokenSpan] | None:
    """The frames of each of ``tokens`` on the forced CTC alignment to ``log_probs`` ``(T, V)``
    (one utterance's, its padding cut off); None when ``tokens`` cannot be aligned to ``T`` frames
    (CTC needs a frame per token and a blank between two equal tokens: an attention hypothesis may
    be longer than that). No tokens: no spans."""
    tokens = list(tokens)
    if not tokens:
        return []
    if ctc_frames_needed(tokens) > len(log_probs):
        return None
    # forced_align runs on the CPU, in float32, one utterance at a time
    emissions = log_probs.detach().to("cpu", torch.float32).contiguous()[None]
    targets = torch.tensor([tokens], dtype=torch.int32)
    labels, scores = TAF.forced_align(emissions, targets, blank=BLANK_ID)
    spans = TAF.merge_tokens(labels[0], scores[0].exp(), blank=BLANK_ID)
    return [TokenSpan(s.token, s.start, s.end, min(1.0, max(0.0, s.score))) for s in spans]


def word_probability(token_probabilities: Sequence[float]) -> float:
    """A word's probability from its tokens': the least of them (see the module)."""
    return min(token_probabilities)


def words_of_spans(tokenizer: Tokenizer, spans: Sequence[TokenSpan], offset: float = 0.0,
                   duration: float | None = None) -> list[Word]:
    """The words of aligned token ``spans``, their times in seconds from ``offset`` (the start of
    the utterance, segment or window in the stream or file) shifted by ``START_SHIFT`` and
    ``END_SHIFT``, within ``offset`` .. ``offset + duration`` when the duration is given, in order
    and not overlapping."""
    groups: list[list[TokenSpan]] = []
    for span, piece in zip(spans, tokenizer.pieces([s.token for s in spans])):
        if piece.startswith(WORD_START) or not groups:
            groups.append([])
        if piece != WORD_START:  # a space alone (character tokenizers): no part of the word's time
            groups[-1].append(span)
    groups = [g for g in groups if g]
    starts = [offset + g[0].start * FRAME_SECONDS + START_SHIFT for g in groups]
    ends = [offset + g[-1].end * FRAME_SECONDS + END_SHIFT for g in groups]
    for i in range(1, len(groups)):
        # shifted words that overlap meet half-way: the raw spans never overlap, so both keep time
        if ends[i - 1] > starts[i]:
            ends[i - 1] = starts[i] = (ends[i - 1] + starts[i]) / 2
    # In whole milliseconds: each word within the audio, after the one before it, at least 1 ms
    # long, whatever the shifts (the room it leaves for the words after it kept).
    low = round(offset * 1000)
    high = None if duration is None else round((offset + duration) * 1000)
    words = []
    for i, (group, start, end) in enumerate(zip(groups, starts, ends)):
        start_ms = max(round(start * 1000), low)
        end_ms = max(round(end * 1000), start_ms + 1)
        if high is not None:
            end_ms = min(end_ms, high - (len(groups) - 1 - i))
            start_ms = min(start_ms, end_ms - 1)
        low = end_ms
        probability = round(word_probability([s.probability for s in group]), 3)
        words.append(Word(tokenizer.decode([s.token for s in group]), start_ms / 1000,
                          end_ms / 1000, probability))
    return words


def align_words(tokenizer: Tokenizer, tokens: Sequence[int], log_probs: torch.Tensor,
                offset: float = 0.0, duration: float | None = None) -> list[Word]:
    """The words of the hypothesis ``tokens`` with their times and probabilities, from its forced
    alignment to the CTC log-probabilities ``log_probs`` ``(T, V)`` of the forward pass that
    decoded it (``align_tokens``), in seconds from ``offset`` (``words_of_spans``). Empty when the
    tokens cannot be aligned to so few frames."""
    spans = align_tokens(log_probs, tokens)
    return [] if spans is None else words_of_spans(tokenizer, spans, offset, duration)
