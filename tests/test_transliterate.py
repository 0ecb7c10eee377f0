"""The Devanagari transliteration that lets festival's voices of other languages read Konkani."""
import pytest

from konkanivani.datatools.corpus import (
    DEFAULT_SENTENCES,
    DEFAULT_TEXT,
    FESTIVAL_TRAIN_VOICES,
    load_sentences,
)
from konkanivani.datatools.transliterate import (
    CONSONANTS,
    ENGLISH_PHONES,
    NASALS,
    VIRAMA,
    VISARGA,
    VOWEL_LETTERS,
    VOWEL_SIGNS,
    VOWELS,
    english_segments,
    phrases,
    spell,
    word_phones,
)


@pytest.mark.parametrize("word, phones", [
    ("कर", ["k", "a", "r"]),  # the final inherent vowel is dropped...
    ("न", ["n", "a"]),  # ...but not in a word of one syllable
    # VC-a-CV: the medial one too; the nasal sign at the end: n
    ("तुमचें", ["t", "u", "m", "c", "e", "n"]),
    ("नमस्कार", ["n", "a", "m", "a", "s", "k", "aa", "r"]),  # the virama joins s and k
    ("अंबो", ["a", "m", "b", "o"]),  # the nasal sign takes the place of the next consonant
    ("रंग", ["r", "a", "ng", "g"]),
    ("म्हाका", ["m", "h", "aa", "k", "aa"]),
    ("मेळून", ["m", "e", "L", "uu", "n"]),
    ("मित्र", ["m", "i", "t", "r", "a"]),  # after a cluster the final vowel stays
    ("\u091c\u093cरा", ["z", "a", "r", "aa"]),  # a nukta, after its consonant...
    ("\u095bरा", ["z", "a", "r", "aa"]),  # ...or in a precomposed letter
    ("फ़ोन", ["f", "o", "n"]),
])
def test_word_phones(word, phones):
    assert word_phones(word) == phones


@pytest.mark.parametrize("word", ["abc", "१२", "3"])
def test_a_character_it_cannot_read_is_an_error_not_silence(word):
    with pytest.raises(ValueError, match="cannot transliterate"):
        word_phones(word)


def _english_phones(text: str) -> str:
    """The phones of ``text``'s festival Segments (``english_segments``), in order."""
    import re
    return " ".join(re.findall(r"\(([a-z]+) ", english_segments(text)))


def test_spelled_in_each_orthography():
    text = "तुमकां मेळून म्हाका खूब खोस जाली।"
    assert spell(text, "cs") == "tumkán mélún mháká khúb khos džálí."
    assert spell(text, "fi") == "tumkaan meeluun mhaakaa khuub khoos djaalii."
    assert spell(text, "it") == "tumcan melun maca cub cos giali."  # c before a, gi for j before a
    assert spell("कितें, जेवण", "it") == "chiten, gevan."  # ch before i, g before e
    # not before ai and ri, which are spelled a.., r..
    assert spell("जैत कृपा", "it") == "giait cripa."
    assert spell(text, "ca") == "tumcan melun maca cub coss tjali."
    assert _english_phones("हांव, बरो") == "pau hh aa n v pau b ah r ow pau"


def test_phrases_split_at_punctuation():
    assert [len(p) for p in phrases("नमस्कार, तुमी कशे आसात? बरें।")] == [1, 3, 1]


def test_every_letter_of_the_demo_sentences_is_known_and_every_voice_can_read_them():
    """Each character of the package's sentences is a letter the transliteration knows (or
    punctuation and space), and each sentence encodes in every training voice's input encoding, or
    is all known English
    phones: no sentence reaches a voice half-read."""
    known = (
        set(CONSONANTS) | set(VOWEL_LETTERS) | set(VOWEL_SIGNS) | set(NASALS) | {VIRAMA, VISARGA}
    )
    sentences = load_sentences(DEFAULT_SENTENCES) + load_sentences(DEFAULT_TEXT)
    letters = {ch for s in sentences for ch in s if "\u0900" <= ch <= "\u097f"}
    assert letters - known - {"।", "॥"} == set()
    phones = set(" ".join(ENGLISH_PHONES.values()).split()) | {"pau"}
    for voice in FESTIVAL_TRAIN_VOICES.values():
        for s in sentences:
            if voice.language == "en":
                assert set(_english_phones(s).split()) <= phones
            else:
                spelled = spell(s, voice.language)
                spelled.encode(voice.encoding)
                assert len(spelled) > 1 and not any("\u0900" <= ch <= "\u097f" for ch in spelled)


def test_english_segments_scale_with_the_stretch_and_fall_in_pitch_through_a_phrase():
    """Festival Segments: (phone duration [(position f0)]); the phones are ENGLISH_PHONES' of the
    words' phones with a pause between phrases, and the durations scale with the stretch; the
    vowels' F0 falls from 1.15 to 0.85 times the mean in a phrase.
    """
    import re
    text = "तुमकां मेळून, म्हाका खूब खोस जाली।"
    segment = re.compile(r"\((\S+) ([\d.]+)(?: \(([\d.]+) ([\d.]+)\))?\)")
    segs = segment.findall(english_segments(text, 1.0, 100))
    spoken = (" ".join(ENGLISH_PHONES[p] for word in phrase for p in word)
              for phrase in phrases(text))
    assert [name for name, *_ in segs] == ("pau " + " pau ".join(spoken) + " pau").split()
    slow = segment.findall(english_segments(text, 1.5, 100))
    assert [float(d) for _, d, *_ in slow] == pytest.approx(
        [1.5 * float(d) for _, d, *_ in segs], abs=2e-3
    )
    f0 = [float(f) for *_, f in segs if f]
    assert f0[0] == pytest.approx(115) and f0[-1] == pytest.approx(85)
    assert f0[:4] == sorted(f0[:4], reverse=True) and f0[4:] == sorted(f0[4:], reverse=True)
    assert len(f0) == sum(p in VOWELS for phrase in phrases(text) for w in phrase for p in w)
