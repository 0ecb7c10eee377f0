"""Hotwords: contextual biasing of the searches towards listed words and phrases.

A hotword list is a few words or phrases (names of people, villages, rivers) that the model rarely
or never saw, each with a boost. ``ContextGraph`` holds them as an Aho-Corasick automaton over the
model's token ids: a trie of the phrases' tokens, with for each node the longest proper suffix of
its tokens that is also a trie node (its fail link). A hypothesis carries a ``ContextState`` (a
node) and, as it grows by a token, earns the change in the node's pending bonus (``step``):

- a token that continues a phrase earns the phrase's boost;
- a token that breaks a partial match takes back what the partial match earned (the pending bonus of
  the node it leaves), less what the longest suffix still matching keeps;
- a token that completes a phrase locks its bonus in (``output``: the phrase's whole bonus, and
  those of the phrases ending at the same token on its fail chain), so that leaving the node later
  takes back nothing of it;
- at the end of a hypothesis ``final`` takes back a partial match still pending.

So a hypothesis's context bonus is the sum of the bonuses of the phrases it holds, plus, while it
is being searched, the pending bonus of the phrase it is in the middle of: the beam keeps a
hypothesis that is spelling a hotword, and a hypothesis that only started one gains nothing in the
end. This is the design of icefall's ``ContextGraph`` (k2-fsa/icefall, icefall/context_graph.py),
written here for the CTC prefix beam search, attention rescoring and joint decoding of
``decoding.search``.

Word starts: each phrase is tokenized as the model's tokenizer writes a text, so its first token is
a word's first piece, the one SentencePiece marks with "▁" (a character tokenizer writes "▁" as a
token of its own): a hotword matches at the start of a word, never inside one. A token that is the
mark "▁" alone earns nothing: every word starts with it.

A hotword list is lines of ``phrase`` or ``phrase :BOOST`` (a boost per token of that phrase, else
the default boost), as ``--hotwords FILE`` reads them (``read_hotwords``: blank lines and lines
starting with "#" skipped) and as a caller passes them (``DecodingConfig.hotwords``; a request's
text with ``split_hotwords``). This module imports nothing of torch: the settings check the lines
with it.
"""
from __future__ import annotations

import logging
import math
import re
import threading
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..data.tokenizer import UNK_ID, normalize_text

if TYPE_CHECKING:
    from ..data.tokenizer import Tokenizer

__all__ = ["MAX_BOOST", "MAX_HOTWORD_CHARS", "ContextGraph", "ContextState", "GraphCache",
           "Hotword", "HotwordError", "context_graph", "hotword_tokens", "parse_hotword",
           "read_hotwords", "split_hotwords"]

log = logging.getLogger("konkanivani")

WORD_START = "\u2581"  # SentencePiece's mark of a word's first piece
BOOST_MARK = ":"  # "phrase :BOOST"
COMMENT = "#"  # a line of a hotwords file starting with it is a comment
# A hotword is a name or a short phrase: a longer line is a mistake (or a request's attack: six
# 1 MB keywords held the server's decode thread 11.7 s and 1 GB while their graph was built).
MAX_HOTWORD_CHARS = 100
# The largest boost per token. A token's log-probability is rarely below -30, so a larger boost
# changes nothing more; a huge one (1e300) overflows float32 to inf, inf - inf is NaN, and joint
# decoding ranked every hypothesis as NaN and gave empty text.
MAX_BOOST = 100.0
# The graphs kept for lists seen again (``GraphCache``), in bytes as ``ContextGraph.nbytes``
# counts them, and the remembered moves of one graph (``ContextGraph.step``): joint decoding asks a
# whole vocabulary's moves from each node it visits.
GRAPH_CACHE_BYTES = 64 * 2 ** 20
MAX_MOVES = 2 ** 16
# What one node and one remembered move hold, in bytes (measured with tracemalloc: about 380 and
# 130), rounded up: ``nbytes`` bounds a graph's memory rather than guessing it low.
NODE_BYTES, MOVE_BYTES = 512, 192


class HotwordError(ValueError):
    """A hotword, a hotwords file or a boost that cannot be used; the message is one line."""


@dataclass(frozen=True)
class Hotword:
    phrase: str  # normalized (``normalize_text``), as the tokenizer reads it
    boost: float | None  # per token; None: the default boost


def parse_hotword(line: str) -> Hotword:
    """The hotword of one line, ``phrase`` or ``phrase :BOOST``; ``HotwordError`` saying why it is
    not one (no words in it, longer than ``MAX_HOTWORD_CHARS``, a boost that is not a number from
    0 to ``MAX_BOOST``)."""
    phrase, boost = line, None
    if BOOST_MARK in line:
        phrase, _, text = line.rpartition(BOOST_MARK)
        text = text.strip()
        if not text:
            raise HotwordError(f"no boost after {BOOST_MARK!r} (write 'phrase {BOOST_MARK}2.0')")
        try:
            boost = float(text)
        except ValueError:
            raise HotwordError(f"boost {text!r} is not a number") from None
        if not (math.isfinite(boost) and boost >= 0):
            raise HotwordError(f"boost {text} must be a number >= 0")
        if boost > MAX_BOOST:
            raise HotwordError(f"boost {text} is above {MAX_BOOST:g}, the most a token earns")
    # checked before it is normalized: a long line costs nothing more
    if len(phrase.strip()) > MAX_HOTWORD_CHARS:
        raise HotwordError(f"{len(phrase.strip())} characters: a hotword is a word or a phrase of "
                           f"at most {MAX_HOTWORD_CHARS}")
    normalized = normalize_text(phrase)
    if not normalized:
        raise HotwordError("no word in it")
    return Hotword(normalized, boost)


def read_hotwords(path: str | Path) -> tuple[str, ...]:
    """The hotword lines of a file, one phrase a line (``phrase`` or ``phrase :BOOST``; blank lines
    and lines starting with "#" skipped), each checked with ``parse_hotword``. ``HotwordError`` in
    one line naming the file, and the line where one is wrong."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise HotwordError(f"{path}: file not found") from None
    except OSError as e:  # a folder, no permission ...
        raise HotwordError(f"{path}: cannot be read ({e.strerror or type(e).__name__})") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise HotwordError(f"{path}:{line}: not UTF-8 text") from None
    lines = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith(COMMENT):
            continue
        try:
            parse_hotword(line)
        except HotwordError as e:
            raise HotwordError(f"{path}:{number}: {line!r}: {e}") from None
        lines.append(line)
    if not lines:
        raise HotwordError(f"{path}: no hotword in it (one word or phrase a line)")
    return tuple(lines)


def split_hotwords(text: str) -> list[str]:
    """The hotword lines of a text that lists them one a line or separated by commas (a request's
    field): ``"पणजी, मांडवी :2"`` -> ``["पणजी", "मांडवी :2"]``; empty items dropped."""
    return [item.strip() for item in re.split(r"[\n,]", text) if item.strip()]


class ContextState:
    """A node of the automaton: the tokens of a prefix of a phrase (the root: none)."""

    __slots__ = ("token", "depth", "pending", "output", "is_end", "children", "fail", "moves")

    def __init__(self, token: int = -1, depth: int = 0, pending: float = 0.0):
        self.token, self.depth = token, depth
        # the bonus the tokens so far have earned, taken back unless a phrase is completed
        self.pending = pending
        self.output = 0.0  # the bonus locked in on reaching it (phrases ending here)
        self.is_end = False  # a phrase ends here
        self.children: dict[int, ContextState] = {}
        self.fail: ContextState | None = None
        # token -> (next node, bonus) as ``ContextGraph.step`` found them
        self.moves: dict[int, tuple[ContextState, float]] = {}


class ContextGraph:
    """The hotwords' automaton over token ids (see the module). ``phrases`` are token id lists,
    each with the bonus of each of its tokens.

    Examples:
        >>> g = ContextGraph([([5, 6, 7], [1.0, 1.0, 1.0])])
        >>> s, bonus = g.step(g.root, 5); bonus
        1.0
        >>> s, bonus = g.step(s, 6); g.step(s, 9)[1]  # a partial match taken back
        -2.0
        >>> g.score([4, 5, 6, 7, 4]), g.score([5, 6]), g.score([5, 6, 5, 6, 7])
        (3.0, 0.0, 3.0)
    """

    def __init__(self, phrases: Iterable[tuple[Sequence[int], Sequence[float]]],
                 skipped: Sequence[str] = ()):
        self.root = ContextState()
        self.phrases = 0
        self.nodes = 1  # the root's too
        self.moves = 0  # remembered by ``step``: at most ``MAX_MOVES``
        self.skipped = list(skipped)  # the hotwords left out (``context_graph`` says why)
        for tokens, bonuses in phrases:
            self._insert(list(tokens), list(bonuses))
        self._link()
        self.active = self._any_bonus(self.root)

    def _insert(self, tokens: list[int], bonuses: list[float]) -> None:
        if not tokens:
            return
        self.phrases += 1
        node = self.root
        for token, bonus in zip(tokens, bonuses, strict=True):
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = ContextState(token, node.depth + 1,
                                                            node.pending + bonus)
                self.nodes += 1
            elif node.pending + bonus > child.pending:
                # a prefix two phrases share earns the larger boost
                self._raise(child, node.pending + bonus - child.pending)
            node = child
        node.is_end = True

    @staticmethod
    def _raise(node: ContextState, by: float) -> None:
        """Add ``by`` to the pending bonus of ``node`` and every node below it."""
        stack = [node]
        while stack:
            each = stack.pop()
            each.pending += by
            stack.extend(each.children.values())

    def _link(self) -> None:
        """Fail links and outputs, breadth first: a node's fail link is the deepest node whose
        tokens are a proper suffix of its own; its output, the pending bonus of the phrase ending
        there (if one does) plus its fail link's output."""
        queue: deque[ContextState] = deque()
        for child in self.root.children.values():
            child.fail = self.root
            child.output = child.pending if child.is_end else 0.0
            queue.append(child)
        while queue:
            node = queue.popleft()
            for token, child in node.children.items():
                fail = node.fail
                while fail is not self.root and token not in fail.children:
                    fail = fail.fail
                child.fail = fail.children.get(token, self.root)
                child.output = (child.pending if child.is_end else 0.0) + child.fail.output
                queue.append(child)

    @staticmethod
    def _any_bonus(root: ContextState) -> bool:
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            if node.pending or node.output:
                return True
            stack.extend(node.children.values())
        return False

    def step(self, state: ContextState, token: int) -> tuple[ContextState, float]:
        """The node after ``token`` from ``state``, and the bonus that earns (negative when a
        partial match is taken back)."""
        move = state.moves.get(token)
        if move is None:
            node = state
            while node is not self.root and token not in node.children:
                node = node.fail
            nxt = node.children.get(token, self.root)
            move = (nxt, nxt.pending - state.pending + nxt.output)
            if self.moves < MAX_MOVES:  # past it, found again each time
                state.moves[token] = move
                self.moves += 1
        return move

    @property
    def nbytes(self) -> int:
        """The most memory the graph holds, in bytes: its nodes, and the moves ``step`` may
        remember (``MAX_MOVES``), whether it has found them yet or not."""
        return self.nodes * NODE_BYTES + MAX_MOVES * MOVE_BYTES

    @staticmethod
    def final(state: ContextState) -> float:
        """The bonus of ending a hypothesis at ``state``: a partial match taken back."""
        return -state.pending

    def row(self, state: ContextState, vocab_size: int, end_id: int) -> list[float]:
        """``step``'s bonus for each of ``vocab_size`` tokens from ``state``; at ``end_id`` (the end
        symbol) ``final``'s."""
        out = [self.step(state, token)[1] for token in range(vocab_size)]
        out[end_id] = self.final(state)
        return out

    def score(self, tokens: Iterable[int]) -> float:
        """The context bonus of a whole hypothesis: its phrases' bonuses."""
        state, total = self.root, 0.0
        for token in tokens:
            state, bonus = self.step(state, token)
            total += bonus
        return total + self.final(state)


def context_graph(hotwords: Sequence[str], boost: float, tokenizer: Tokenizer
                  ) -> ContextGraph | None:
    """The ``ContextGraph`` of hotword lines (checked ones: ``parse_hotword``) for ``tokenizer``,
    each token of a phrase earning its line's boost or ``boost``; None when there are none. A
    hotword the tokenizer cannot spell (a character it does not know) is left out, and one warning
    names those left out. The same lines give the same graph while ``GRAPH_CACHE`` keeps it."""
    if not hotwords:
        return None
    key = (tuple(hotwords), float(boost), tokenizer)
    graph = GRAPH_CACHE.get(key)
    if graph is None:
        graph = GRAPH_CACHE.put(key, _graph(*key))
    return graph


def hotword_tokens(hotwords: Iterable[str], tokenizer: Tokenizer) -> int:
    """The tokens of hotword lines (checked ones) as ``tokenizer`` spells them: the size of their
    graph, which a request's limit is counted in."""
    return sum(len(tokenizer.encode(parse_hotword(line).phrase)) for line in hotwords)


class GraphCache:
    """The graphs of the hotword lists used last, kept while their ``nbytes`` sum to at most
    ``max_bytes``: the least recently used go first, and a graph larger than the whole is used and
    not kept. A list the server's requests send again (its own ``--hotwords``, a client's fixed
    list) is built once, and no request's graph stays after others have come."""

    def __init__(self, max_bytes: int = GRAPH_CACHE_BYTES):
        self.max_bytes, self.nbytes = max_bytes, 0
        self._graphs: OrderedDict[tuple, ContextGraph] = OrderedDict()
        self._lock = threading.Lock()  # the server decodes on threads

    def __len__(self) -> int:
        return len(self._graphs)

    def get(self, key: tuple) -> ContextGraph | None:
        with self._lock:
            graph = self._graphs.get(key)
            if graph is not None:
                self._graphs.move_to_end(key)
            return graph

    def put(self, key: tuple, graph: ContextGraph) -> ContextGraph:
        """``graph``, kept under ``key`` if it fits, the least recently used dropped for it."""
        with self._lock:
            if key in self._graphs or graph.nbytes > self.max_bytes:
                return graph
            self._graphs[key] = graph
            self.nbytes += graph.nbytes
            while self.nbytes > self.max_bytes:
                self.nbytes -= self._graphs.popitem(last=False)[1].nbytes
            return graph

    def clear(self) -> None:
        with self._lock:
            self._graphs.clear()
            self.nbytes = 0


GRAPH_CACHE = GraphCache()


def _graph(hotwords: tuple[str, ...], boost: float, tokenizer: Tokenizer) -> ContextGraph:
    phrases, skipped = [], []
    for line in hotwords:
        word = parse_hotword(line)
        ids = tokenizer.encode(word.phrase)
        if not ids or UNK_ID in ids:
            skipped.append(word.phrase)
            continue
        each = boost if word.boost is None else word.boost
        # the word-start mark alone is in every word: it anchors a match at a word's start and
        # earns nothing
        phrases.append((ids, [0.0 if piece == WORD_START else each
                              for piece in tokenizer.pieces(ids)]))
    if skipped:
        log.warning("%d of %d hotwords left out: the model's tokenizer cannot spell them "
                    "(characters it does not know): %s", len(skipped), len(hotwords),
                    ", ".join(skipped[:10]) + (" ..." if len(skipped) > 10 else ""))
    return ContextGraph(phrases, skipped)
