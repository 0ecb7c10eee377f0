"""Text normalization for Devanagari Konkani and the SentencePiece tokenizer.

The same ``normalize_text`` runs on training transcripts, on references during validation and
before tokenizer training, so punctuation and danda are treated one way everywhere.

Token ids: 0 is the CTC blank (SentencePiece's pad piece), 1 is ``<unk>`` and 2 is ``<sos/eos>``,
shared as start and end symbol of the attention decoder.
"""
from __future__ import annotations

import io
import re
import unicodedata
from pathlib import Path
from typing import Iterable, Sequence

import sentencepiece as spm

from ..config import DEFAULT_VOCAB_SIZE

__all__ = ["normalize_text", "Tokenizer", "train_tokenizer", "BLANK_ID", "UNK_ID", "SOS_EOS_ID"]

BLANK_ID = 0
UNK_ID = 1
SOS_EOS_ID = 2

_SPACES = re.compile(r"\s+")


def _map_char(ch: str) -> str:
    category = unicodedata.category(ch)
    # Format characters (Cf: zero-width joiners, soft hyphen, direction marks, BOM) change how a
    # word is drawn, not what is said.
    if category == "Cf":
        return ""
    # P* covers danda (U+0964), double danda (U+0965), the abbreviation sign (U+0970), ASCII and
    # typographic punctuation; S* covers symbols such as currency and math signs.
    if category[0] in "PS":
        return " "
    return ch


def normalize_text(text: str) -> str:
    """Canonical form of a transcript: NFC, no punctuation or danda, single spaces, Latin
    lower-case.

    >>> normalize_text("  मुजें  नांव, राम ।  तुजें?")
    'मुजें नांव राम तुजें'
    """
    text = "".join(map(_map_char, unicodedata.normalize("NFC", text)))
    return _SPACES.sub(" ", text).strip().lower()


class Tokenizer:
    """A SentencePiece model held as bytes, so it can travel inside a checkpoint."""

    def __init__(self, model_proto: bytes):
        self.model_proto = bytes(model_proto)
        self._sp = spm.SentencePieceProcessor(model_proto=self.model_proto)
        if (
            self._sp.pad_id() != BLANK_ID
            or self._sp.unk_id() != UNK_ID
            or self._sp.eos_id() != SOS_EOS_ID
        ):
            raise ValueError(
                "tokenizer was not made by konkanivani.train_tokenizer (special ids differ)"
            )

    @classmethod
    def load(cls, path: str | Path) -> "Tokenizer":
        return cls(Path(path).read_bytes())

    def save(self, path: str | Path) -> None:
        Path(path).write_bytes(self.model_proto)

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of the normalized text (no blank, no sos/eos)."""
        return self._sp.encode(normalize_text(text), out_type=int)

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids if int(i) not in (BLANK_ID, SOS_EOS_ID)]
        return self._sp.decode(ids)

    def pieces(self, ids: Sequence[int]) -> list[str]:
        return [self._sp.id_to_piece(int(i)) for i in ids]


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE, model_type: str = "unigram"
) -> Tokenizer:
    """Train SentencePiece on normalized transcripts, in memory.

    ``vocab_size`` is an upper bound for tiny corpora: SentencePiece may return fewer pieces when
    the text cannot support more (``hard_vocab_limit=False``). A ``char`` model ignores it: it has
    a piece for every character of the text (several scripts together may hold more characters
    than any subword vocabulary size; a capped one would leave the rarer ones unencodable).
    """
    sentences = [t for t in (normalize_text(x) for x in texts) if t]
    if not sentences:
        raise ValueError("no non-empty transcript to train the tokenizer on")
    if model_type == "char":  # every character, the word boundary and the special pieces
        vocab_size = len(set("".join(sentences))) + 3 + 1  # <blank>, <unk>, <sos/eos>; ▁
    model = io.BytesIO()
    try:
        _train_sentencepiece(sentences, model, vocab_size, model_type)
    except RuntimeError as e:  # e.g. fewer pieces asked for than the text has characters
        # without SentencePiece's source location
        reason = str(e).strip().splitlines()[-1].split("] ")[-1]
        raise ValueError(
            f"cannot train a {model_type} tokenizer of {vocab_size} pieces: {reason} (--vocab_size;"
            " --tokenizer_type char needs none)"
        ) from e
    return Tokenizer(model.getvalue())


def _train_sentencepiece(
    sentences: list[str], model: io.BytesIO, vocab_size: int, model_type: str
) -> None:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=model,
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=1.0,  # every Devanagari sign seen in training gets a piece
        hard_vocab_limit=False,
        pad_id=BLANK_ID, pad_piece="<blank>",
        unk_id=UNK_ID, unk_piece="<unk>",
        bos_id=-1,
        eos_id=SOS_EOS_ID, eos_piece="<sos/eos>",
        normalization_rule_name="identity",  # normalize_text has done it
        minloglevel=2,
        num_threads=1,
    )
