"""Konkani (Devanagari) spelled for synthesizers of other languages.

The demo corpus has festival's diphone and HTS voices of other languages (Czech, Finnish, Italian,
Catalan, US English; each recorded from one real speaker) read Konkani sentences, so that training
hears more than one synthesizer. Those voices cannot read Devanagari: a sentence is turned into
phones (inherent vowels, schwa deletion, homorganic nasals), then spelled in the voice's own
orthography, where letters are read as written, or given as festival's US English phones.

>>> spell("नमस्कार, तुमी कशे आसात?", "cs")
'namaskár, tumí kašé ását.'
"""
from __future__ import annotations

import re
import unicodedata

CONSONANTS = {
    "क": "k",
    "ख": "kh",
    "ग": "g",
    "घ": "gh",
    "ङ": "ng",
    "च": "c",
    "छ": "ch",
    "ज": "j",
    "झ": "jh",
    "ञ": "ny",
    "ट": "T",
    "ठ": "Th",
    "ड": "D",
    "ढ": "Dh",
    "ण": "N",
    "त": "t",
    "थ": "th",
    "द": "d",
    "ध": "dh",
    "न": "n",
    "प": "p",
    "फ": "ph",
    "ब": "b",
    "भ": "bh",
    "म": "m",
    "य": "y",
    "र": "r",
    "ऱ": "r",
    "ल": "l",
    "ळ": "L",
    "व": "v",
    "श": "sh",
    "ष": "sh",
    "स": "s",
    "ह": "h",
}
# A consonant with a nukta (ज़, फ़, ...; precomposed letters are decomposed first).
NUKTA = "\u093c"
WITH_NUKTA = {"क": "k", "ख": "kh", "ग": "g", "ज": "z", "ड": "D", "ढ": "Dh", "फ": "f", "य": "y"}
VOWEL_LETTERS = {
    "अ": "a",
    "आ": "aa",
    "इ": "i",
    "ई": "ii",
    "उ": "u",
    "ऊ": "uu",
    "ए": "e",
    "ऐ": "ai",
    "ओ": "o",
    "औ": "au",
    "ऍ": "ae",
    "ऑ": "ao",
    "ॲ": "ae",
    "ऋ": "ri",
}
VOWEL_SIGNS = {
    "ा": "aa",
    "ि": "i",
    "ी": "ii",
    "ु": "u",
    "ू": "uu",
    "े": "e",
    "ै": "ai",
    "ो": "o",
    "ौ": "au",
    "ॅ": "ae",
    "ॉ": "ao",
    "ृ": "ri",
}
VIRAMA, NASALS, VISARGA, AVAGRAHA = "्", "ंँ", "ः", "ऽ"
VOWELS = frozenset(VOWEL_LETTERS.values()) | {"a0"}
INHERENT = "a0"  # the consonant's own vowel, which schwa deletion may drop
LABIAL, VELAR = {"p", "ph", "b", "bh", "m"}, {"k", "kh", "g", "gh"}
FRONT = {"e", "i", "ii", "ae"}  # the vowels spelled with e or i, before which c and g soften
PHRASE_BREAK = re.compile(r"[,.!?।॥;:\-\"'()]+")


def word_phones(word: str) -> list[str]:
    """One Devanagari word's phones: 'a' for a spoken inherent vowel, 'n'/'m'/'ng' for the nasal
    sign. Raises ValueError on a character it cannot read (a digit, a Latin letter): the voice would
    skip it,
    and its audio would no longer say the transcript."""
    word = unicodedata.normalize("NFD", word)
    out: list[str] = []
    for i, ch in enumerate(word):
        if ch in CONSONANTS:
            nukta = word[i + 1:i + 2] == NUKTA
            out.append(WITH_NUKTA.get(ch, CONSONANTS[ch]) if nukta else CONSONANTS[ch])
            nxt = word[i + 1 + nukta:i + 2 + nukta]
            if nxt != VIRAMA and nxt not in VOWEL_SIGNS:
                out.append(INHERENT)
        elif ch in VOWEL_SIGNS:
            out.append(VOWEL_SIGNS[ch])
        elif ch in VOWEL_LETTERS:
            out.append(VOWEL_LETTERS[ch])
        elif ch in NASALS:
            out.append("~")
        elif ch == VISARGA:
            out.append("h")
        elif ch not in (VIRAMA, NUKTA, AVAGRAHA):
            raise ValueError(f"cannot transliterate {ch!r} (U+{ord(ch):04X}) in {word!r}")
    _delete_schwas(out)
    phones = []
    for i, p in enumerate(out):
        if p == "~":  # the nasal sign: a nasal of the next consonant's place (n at the word's end)
            nxt = out[i + 1] if i + 1 < len(out) else ""
            p = "m" if nxt in LABIAL else "ng" if nxt in VELAR else "n"
        phones.append("a" if p == INHERENT else p)
    return phones


def _delete_schwas(out: list[str]) -> None:
    """Konkani drops the inherent vowel at a word's end (after another vowel, not after a cluster:
    मित्र keeps it) and between a vowel-consonant and a consonant-vowel (तुमचें: tum-chẽ), right to
    left as in Hindi."""
    cluster = len(out) >= 3 and out[-2] not in VOWELS and out[-3] not in VOWELS | {"~"}
    if sum(p in VOWELS for p in out) > 1 and out[-1] == INHERENT and not cluster:
        out.pop()
    for i in range(len(out) - 3, 1, -1):
        if (out[i] == INHERENT and out[i - 2] in VOWELS | {"~"} and out[i - 1] not in VOWELS
                and out[i + 1] not in VOWELS | {"~"} and out[i + 2] in VOWELS):
            del out[i]


def phrases(text: str) -> list[list[list[str]]]:
    """The text's phrases (split at punctuation), each a list of words' phones."""
    words = ([word_phones(w) for w in part.split()] for part in PHRASE_BREAK.split(text))
    return [[w for w in phrase if w] for phrase in words if any(phrase)]


# Each language's letters for a phone: a string, or (before a back vowel, before a front vowel) for
# the letters that soften before e and i (Italian c/g, Catalan c/g/j).
_BASE = {
    "a": "a",
    "aa": "a",
    "i": "i",
    "ii": "i",
    "u": "u",
    "uu": "u",
    "e": "e",
    "o": "o",
    "ai": "ai",
    "au": "au",
    "ae": "e",
    "ao": "o",
    "ri": "ri",
    "k": "k",
    "kh": "kh",
    "g": "g",
    "gh": "gh",
    "ng": "n",
    "c": "č",
    "ch": "čh",
    "j": "dž",
    "jh": "džh",
    "ny": "ň",
    "T": "t",
    "Th": "th",
    "D": "d",
    "Dh": "dh",
    "N": "n",
    "t": "t",
    "th": "th",
    "d": "d",
    "dh": "dh",
    "n": "n",
    "p": "p",
    "ph": "ph",
    "b": "b",
    "bh": "bh",
    "m": "m",
    "y": "j",
    "r": "r",
    "l": "l",
    "L": "l",
    "v": "v",
    "sh": "š",
    "s": "s",
    "h": "h",
    "z": "z",
    "f": "f",
}
SPELLINGS: dict[str, dict[str, str | tuple[str, str]]] = {
    # Czech: long vowels with an acute, č š dž as in Konkani; h is voiced, as in bh dh gh.
    "cs": {**_BASE, "aa": "á", "ii": "í", "uu": "ú", "e": "é", "ai": "aj"},
    # Finnish: long vowels doubled; it spells out š and č letter by letter, so those are plain.
    "fi": {
        **_BASE,
        "aa": "aa",
        "ii": "ii",
        "uu": "uu",
        "e": "ee",
        "o": "oo",
        "ae": "ä",
        "c": "ts",
        "ch": "tsh",
        "j": "dj",
        "jh": "djh",
        "ny": "nj",
        "sh": "s",
        "z": "s",
    },
    # Italian: c/g soften before e and i; h is silent, so aspiration is lost.
    "it": {
        **_BASE,
        "k": ("c", "ch"),
        "kh": ("c", "ch"),
        "g": ("g", "gh"),
        "gh": ("g", "gh"),
        "c": ("ci", "c"),
        "ch": ("ci", "c"),
        "j": ("gi", "g"),
        "jh": ("gi", "g"),
        "sh": ("sci", "sc"),
        "ny": "gn",
        "y": "i",
        "h": "",
        "Th": "t",
        "th": "t",
        "Dh": "d",
        "dh": "d",
        "ph": "f",
        "bh": "b",
        "z": "s",
    },
    # Catalan: c/qu, g/gu, tx and tj for ch and j, x for sh; h is silent.
    "ca": {
        **_BASE,
        "k": ("c", "qu"),
        "kh": ("c", "qu"),
        "g": ("g", "gu"),
        "gh": ("g", "gu"),
        "c": "tx",
        "ch": "tx",
        "j": ("tj", "tj"),
        "jh": ("tj", "tj"),
        "sh": "x",
        "ny": "ny",
        "y": "i",
        "h": "",
        "Th": "t",
        "th": "t",
        "Dh": "d",
        "dh": "d",
        "ph": "f",
        "bh": "b",
        "s": "ss",
    },
}
# festival's US English phones (the "radio" set of its diphone voices).
ENGLISH_PHONES = {
    "a": "ah",
    "aa": "aa",
    "i": "ih",
    "ii": "iy",
    "u": "uh",
    "uu": "uw",
    "e": "ey",
    "o": "ow",
    "ai": "ay",
    "au": "aw",
    "ae": "ae",
    "ao": "ao",
    "ri": "r ih",
    "k": "k",
    "kh": "k",
    "g": "g",
    "gh": "g",
    "ng": "ng",
    "c": "ch",
    "ch": "ch",
    "j": "jh",
    "jh": "jh",
    "ny": "n y",
    "T": "t",
    "Th": "t",
    "D": "d",
    "Dh": "d",
    "N": "n",
    "t": "t",
    "th": "t",
    "d": "d",
    "dh": "d",
    "n": "n",
    "p": "p",
    "ph": "f",
    "b": "b",
    "bh": "b",
    "m": "m",
    "y": "y",
    "r": "r",
    "l": "l",
    "L": "l",
    "v": "v",
    "sh": "sh",
    "s": "s",
    "h": "hh",
    "z": "z",
    "f": "f",
}


def _spell_word(phones: list[str], table: dict[str, str | tuple[str, str]]) -> str:
    letters = []
    for i, p in enumerate(phones):
        spelled = table[p]
        if isinstance(spelled, tuple):
            nxt = phones[i + 1] if i + 1 < len(phones) else ""
            spelled = spelled[nxt in FRONT]
        letters.append(spelled)
    return "".join(letters)


def spell(text: str, language: str) -> str:
    """`text` spelled in `language`'s orthography (a key of SPELLINGS), phrases kept with commas."""
    table = SPELLINGS[language]
    return (
        ", ".join(" ".join(_spell_word(w, table) for w in phrase) for phrase in phrases(text)) + "."
    )


# Seconds per phone before the stretch (a rough reading pace); long vowels and diphthongs are
# longer.
SHORT_VOWELS = {"a", "i", "u"}
SECONDS = {"short": 0.07, "long": 0.12, "consonant": 0.065, "pause": 0.18}


def english_segments(text: str, stretch: float = 1.0, f0: float = 110.0) -> str:
    """`text` as a festival Segments list of US English phones: each phone with a duration (seconds,
    times `stretch`), and each vowel with an F0 target that falls through its phrase from 1.15 to
    0.85 times `f0` (Hz), as a declarative phrase does."""
    segments = [f"(pau {SECONDS['pause'] * stretch:.3f})"]
    for phrase in phrases(text):
        phones = [p for word in phrase for p in word]
        vowels = [i for i, p in enumerate(phones) if p in VOWELS]
        for i, p in enumerate(phones):
            kind = "consonant" if p not in VOWELS else "short" if p in SHORT_VOWELS else "long"
            dur = SECONDS[kind] * stretch
            names = ENGLISH_PHONES[p].split()
            for k, name in enumerate(names):
                target = ""
                # the target in the middle of the vowel's own phone
                if i in vowels and k == len(names) - 1:
                    where = vowels.index(i) / max(1, len(vowels) - 1)
                    target = f" ({dur / len(names) / 2:.3f} {f0 * (1.15 - 0.3 * where):.1f})"
                segments.append(f"({name} {dur / len(names):.3f}{target})")
        segments.append(f"(pau {SECONDS['pause'] * stretch:.3f})")
    return " ".join(segments)
