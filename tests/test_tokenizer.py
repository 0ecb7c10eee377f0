import pytest

from konkanivani.data.tokenizer import (
    BLANK_ID,
    SOS_EOS_ID,
    UNK_ID,
    Tokenizer,
    normalize_text,
    train_tokenizer,
)

SENTENCES = [
    "हांव घरा वता।",
    "तूं कितें करता?",
    "आमी काल पणजेक गेलें॥",
    "ताणें जेवण केलें, आनी तो न्हिदलो।",
    "आयज पावस पडटा!",
    "म्हजो भाव शाळेंत शिकता।",
    "तो बाजारांत गेलो आनी मासे हाडले।",
    "ती गीत गायता।",
]


def test_normalize_handles_danda_punctuation_space_and_nfc():
    assert normalize_text("  हांव   घरा वता । ") == "हांव घरा वता"
    assert normalize_text("आमी गेलें॥") == "आमी गेलें"
    assert normalize_text("तूं, कितें? \"करता\"!") == "तूं कितें करता"
    # Decomposed and composed forms of the same letter normalize alike (NFC), and zero-width
    # joiners disappear.
    assert normalize_text("\u0915\u093c") == normalize_text("\u0958")
    assert normalize_text("क\u200dष") == "कष"
    # BOM, soft hyphen, LRM, word joiner
    assert normalize_text("\ufeffकलम\u00ad \u200eघर\u2060") == "कलम घर"
    assert normalize_text("।, ?") == ""


def test_round_trip_and_special_ids():
    tok = train_tokenizer(SENTENCES, vocab_size=60)
    assert tok._sp.id_to_piece(BLANK_ID) == "<blank>"
    assert tok._sp.id_to_piece(UNK_ID) == "<unk>"
    assert tok._sp.id_to_piece(SOS_EOS_ID) == "<sos/eos>"
    for sentence in SENTENCES:
        ids = tok.encode(sentence)
        assert ids and min(ids) > SOS_EOS_ID
        assert tok.decode(ids) == normalize_text(sentence)
    # Blank and sos/eos are dropped when decoding.
    ids = tok.encode(SENTENCES[0])
    assert tok.decode([BLANK_ID, *ids, SOS_EOS_ID]) == normalize_text(SENTENCES[0])


def test_tokenizer_travels_as_bytes(tmp_path):
    tok = train_tokenizer(SENTENCES, vocab_size=50, model_type="bpe")
    again = Tokenizer(tok.model_proto)
    path = tmp_path / "t.model"
    tok.save(path)
    from_file = Tokenizer.load(path)
    for sentence in SENTENCES:
        assert again.encode(sentence) == tok.encode(sentence) == from_file.encode(sentence)


def test_unseen_characters_map_to_unk():
    tok = train_tokenizer(SENTENCES, vocab_size=50)
    assert UNK_ID in tok.encode("ॐ")


def test_empty_training_text_is_an_error():
    with pytest.raises(ValueError, match="no non-empty transcript"):
        train_tokenizer(["", " । "])


def test_character_tokenizer_spells_unseen_words():
    tok = train_tokenizer(["मुजें नांव राम", "तुजें नांव कितें"], model_type="char")
    chars = set("मुजें नांव राम तुजें नांव कितें".replace(" ", ""))
    assert tok.vocab_size <= len(chars) + 4  # characters, the word boundary and the special ids
    unseen = "राम कितें मुजें"  # a new sentence of known characters
    ids = tok.encode(unseen)
    assert UNK_ID not in ids and tok.decode(ids) == unseen
    assert all(len(p.replace("▁", "")) <= 1 for p in tok.pieces(ids))


def test_a_character_tokenizer_of_several_scripts_keeps_every_character_whatever_vocab_size():
    """Latin, Cyrillic, Greek and Devanagari together hold more characters than --vocab_size's
    default: a character model has a piece for each of them, the rarest too."""
    alphabets = ["abcdefghijklmnopqrstuvwxyzàâçéèêëîïôûùüÿœæ",
                 "абвгдежзийклмнопрстуфхцчшщъыьэюяёіўґє",
                 "αβγδεζηθικλμνξοπρστυφχψωάέήίόύώϊϋΐΰς",
                 "अआइईउऊएऐओऔकखगघचछजझटठडढणतथदधनपफबभमयरलवशषसह"]
    # each alphabet's letters common, one rare letter at its end
    sentences = ([" ".join(a[:-1]) for a in alphabets for _ in range(20)]
                 + [a[-1] for a in alphabets])
    characters = set("".join(alphabets))
    assert len(characters) > 128
    for vocab_size in (64, 128):
        tok = train_tokenizer(sentences, vocab_size=vocab_size, model_type="char")
        assert tok.vocab_size >= len(characters) + 3
        for a in alphabets:
            ids = tok.encode(a[-1] + " " + a[:3])
            assert UNK_ID not in ids and tok.decode(ids) == a[-1] + " " + a[:3]
