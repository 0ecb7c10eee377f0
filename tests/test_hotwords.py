"""Hotwords: the context graph against a brute-force count of the phrases in a token sequence, the
word-start rule with real tokenizers, the hotwords file, and a tiny tone model (tone_speech.py)
whose searches a boosted word pulls towards it while a boost of 0 changes nothing."""
import dataclasses
import json
import math
import random

import pytest
import soundfile as sf
import torch
from tone_speech import mixed_speech, speech

from konkanivani.checkpoint import save_checkpoint
from konkanivani.cli import evaluate, transcribe
from konkanivani.config import ConfigError
from konkanivani.data.frames import SAMPLE_RATE
from konkanivani.data.tokenizer import train_tokenizer
from konkanivani.decoding.hotwords import (
    GRAPH_CACHE,
    MAX_BOOST,
    MAX_HOTWORD_CHARS,
    MAX_MOVES,
    ContextGraph,
    GraphCache,
    HotwordError,
    context_graph,
    hotword_tokens,
    parse_hotword,
    read_hotwords,
    split_hotwords,
)
from konkanivani.decoding.search import CTCPrefixBeam, ctc_prefix_beam_search
from konkanivani.decoding.settings import HOTWORD_BOOST, JOINT_HOTWORD_BOOST, DecodingConfig

KONKANI = ["हांव सकाळीं बाजारांत वता", "आमच्या गांवांत एक व्हड देवूळ आसा",
           "आयज खूब पावस पडलो", "राम आनी शाम शाळेंत गेले", "म्हजो आजो आराम करता"]


def graph(*phrases: str, boost: float = 1.0) -> ContextGraph:
    """A graph of phrases written as letters, each letter a token id (a=1 ...)."""
    return ContextGraph([([ord(c) - 96 for c in p], [boost] * len(p)) for p in phrases])


def ids(text: str) -> list[int]:
    return [ord(c) - 96 for c in text]


def occurrences(text: str, phrases: list[str]) -> float:
    """The reference: each occurrence of each phrase, overlapping ones too, earns its length."""
    return sum(len(p) for p in set(phrases) for i in range(len(text)) if text.startswith(p, i))


def test_a_phrase_earns_its_boost_per_token_and_keeps_it_once_complete():
    g = graph("abc")
    state, bonuses = g.root, []
    for token in ids("abc"):
        state, bonus = g.step(state, token)
        bonuses.append(bonus)
    # two tokens pending, then the third locks the phrase's 3 in; ending takes the pending back
    assert bonuses == [1.0, 1.0, 4.0] and g.final(state) == -3.0
    assert g.score(ids("xabcx")) == 3.0 and g.score(ids("abcabc")) == 6.0


def test_a_partial_match_is_taken_back_when_it_breaks_and_at_the_end():
    g = graph("abcd")
    state = g.root
    for token in ids("abc"):
        state, _ = g.step(state, token)
    _, bonus = g.step(state, ids("x")[0])
    assert bonus == -3.0
    assert g.score(ids("abcx")) == 0.0 and g.score(ids("abc")) == 0.0
    # a break that starts the phrase again keeps what the new start earns
    state = g.root
    for token in ids("ab"):
        state, _ = g.step(state, token)
    state, bonus = g.step(state, ids("a")[0])
    assert bonus == -1.0 and state.pending == 1.0
    assert g.score(ids("ababcd")) == 4.0


def test_overlapping_phrases_each_earn_their_boost():
    phrases = ["abc", "bc", "bcd", "c", "abcd"]
    g = graph(*phrases)
    assert g.score(ids("abcd")) == occurrences("abcd", phrases) == 3 + 2 + 3 + 1 + 4


def test_the_graph_equals_a_brute_force_count_on_random_phrases_and_sequences():
    rng = random.Random(0)
    for _ in range(200):
        phrases = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4)))
                   for _ in range(rng.randint(1, 5))]
        g = graph(*phrases)
        text = "".join(rng.choice("abcd") for _ in range(rng.randint(0, 12)))
        assert g.score(ids(text)) == occurrences(text, phrases), (phrases, text)
        # while searching, a hypothesis also holds the pending bonus of the longest suffix that
        # begins a phrase
        state, total = g.root, 0.0
        for token in ids(text):
            state, bonus = g.step(state, token)
            total += bonus
        begun = max((k for k in range(len(text) + 1)
                     if any(p.startswith(text[len(text) - k:]) for p in phrases)), default=0)
        assert total == occurrences(text, phrases) + begun
        assert state.pending == begun


def test_a_boost_of_zero_makes_an_inactive_graph():
    assert not graph("abc", boost=0.0).active and graph("abc").active
    assert not ContextGraph([]).active


@pytest.mark.parametrize("model_type", ["char", "unigram"])
def test_a_hotword_matches_at_a_word_start_only(model_type):
    tok = train_tokenizer(KONKANI * 3, vocab_size=60 if model_type == "unigram" else 128,
                          model_type=model_type)
    g = context_graph(["राम"], 1.0, tok)
    pieces = tok.pieces(tok.encode("राम"))
    assert pieces[0].startswith("\u2581")
    whole = len([p for p in pieces if p != "\u2581"])
    assert g.score(tok.encode("राम आनी शाम")) == whole
    assert g.score(tok.encode("हांव राम")) == whole
    # inside a word ("आराम", rest) it is not the hotword
    assert g.score(tok.encode("म्हजो आजो आराम करता")) == 0.0
    if model_type == "char":
        # the word-start mark alone earns nothing: it starts every word
        assert pieces[0] == "\u2581" and g.step(g.root, tok.encode("राम")[0])[1] == 0.0


def test_a_hotword_the_tokenizer_cannot_spell_is_left_out_with_one_warning(caplog):
    tok = train_tokenizer(KONKANI, model_type="char")
    g = context_graph(["राम", "ऋषी", "औदुंबर"], 2.0, tok)
    assert g.phrases == 1 and g.skipped == ["ऋषी", "औदुंबर"]
    assert "2 of 3 hotwords left out" in caplog.text and "ऋषी" in caplog.text
    assert context_graph([], 2.0, tok) is None


def test_hotword_lines_with_their_boosts():
    assert parse_hotword("  मांडवी  ").phrase == "मांडवी" and parse_hotword("मांडवी").boost is None
    assert parse_hotword("म्हादय न्हंय :2.5").boost == 2.5
    assert parse_hotword("म्हादय न्हंय :2.5").phrase == "म्हादय न्हंय"
    assert parse_hotword("पणजी:0").boost == 0.0
    for line, why in [("पणजी :x", "boost 'x' is not a number"), ("पणजी :", "no boost"),
                      ("पणजी :-1", "must be a number >= 0"), ("पणजी :inf", ">= 0"),
                      ("।। :2", "no word in it"), ("पणजी :1e300", "is above 100"),
                      ("x" * 2 ** 20, f"1048576 characters: .* at most {MAX_HOTWORD_CHARS}")]:
        with pytest.raises(HotwordError, match=why):
            parse_hotword(line)
    assert split_hotwords("पणजी, मांडवी :2\nम्हादय,,") == ["पणजी", "मांडवी :2", "म्हादय"]
    assert parse_hotword(f"{'क' * MAX_HOTWORD_CHARS} :{MAX_BOOST:g}").boost == MAX_BOOST


def test_the_graph_cache_never_holds_more_than_its_bytes():
    """Graphs of lists seen again come from the cache; the least recently used go first, so the
    bytes it holds (each graph's bound, its nodes and the moves it may remember) stay within its
    own; a graph larger than the whole is built and not kept."""
    tok = train_tokenizer(KONKANI, model_type="char")
    rng = random.Random(0)
    words = sorted({w for s in KONKANI for w in s.split()})
    cache = GraphCache(max_bytes=3 * ContextGraph([]).nbytes + 200_000)
    for i in range(40):
        lines = tuple(" ".join(rng.sample(words, 2)) for _ in range(rng.randint(1, 60)))
        graph = ContextGraph([(tok.encode(p), [1.0] * len(tok.encode(p))) for p in lines])
        for state in list(graph.root.children.values())[:3]:
            graph.row(state, tok.vocab_size, 0)  # what joint decoding asks: moves remembered
        assert graph.moves <= MAX_MOVES and graph.nbytes >= graph.nodes * 380 + graph.moves * 130
        assert cache.put(("list", i), graph) is graph
        assert cache.nbytes == sum(g.nbytes for g in cache._graphs.values()) <= cache.max_bytes
        assert cache.get(("list", i)) is graph or graph.nbytes > cache.max_bytes
    assert 1 <= len(cache) <= 3 and cache.get(("list", 0)) is None  # the first went long ago
    small = GraphCache(max_bytes=ContextGraph([]).nbytes)  # room for no node but the root
    huge = ContextGraph([([1, 2], [1.0, 1.0])])
    assert small.put("huge", huge) is huge and small.get("huge") is None and small.nbytes == 0
    # the module's cache: the same lines give the same graph; its bound is GRAPH_CACHE_BYTES
    GRAPH_CACHE.clear()
    assert context_graph(["राम"], 2.0, tok) is context_graph(["राम"], 2.0, tok)
    assert len(GRAPH_CACHE) == 1 and GRAPH_CACHE.nbytes <= GRAPH_CACHE.max_bytes
    assert hotword_tokens(["राम :2", "आमच्या गांवांत"], tok) == sum(
        len(tok.encode(p)) for p in ("राम", "आमच्या गांवांत"))


def test_a_graph_remembers_at_most_max_moves(monkeypatch):
    """Past ``MAX_MOVES`` a move is found again each time, with the same answer."""
    monkeypatch.setattr("konkanivani.decoding.hotwords.MAX_MOVES", 10)
    g, fresh = graph("abc", "bcd"), graph("abc", "bcd")
    rows = [g.row(s, 6, 0) for s in (g.root, *g.root.children.values())]
    assert g.moves == 10 and sum(len(s.moves) for s in (g.root, *g.root.children.values())) == 10
    assert rows == [fresh.row(s, 6, 0) for s in (fresh.root, *fresh.root.children.values())]
    assert g.score(ids("xabcdx")) == occurrences("xabcdx", ["abc", "bcd"])


def test_a_hotwords_file_and_its_errors_name_the_file_and_line(tmp_path):
    good = tmp_path / "hot.txt"
    good.write_bytes("\ufeff# names\nपणजी\n\n  मांडवी :2.5\n".encode())
    assert read_hotwords(good) == ("पणजी", "मांडवी :2.5")
    cases = {"bad.txt": ("पणजी\n# x\nमांडवी :x\n".encode(), r"bad.txt:3: 'मांडवी :x': boost"),
             "latin1.txt": ("पणजी\n".encode() + b"caf\xe9\n", r"latin1.txt:2: not UTF-8"),
             "empty.txt": (b"# none\n\n", r"empty.txt: no hotword in it")}
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(HotwordError, match=message):
            read_hotwords(tmp_path / name)
    with pytest.raises(HotwordError, match="missing.txt: file not found"):
        read_hotwords(tmp_path / "missing.txt")
    with pytest.raises(HotwordError, match="cannot be read"):
        read_hotwords(tmp_path)


def test_the_settings_check_hotwords_once():
    DecodingConfig(hotwords=("पणजी :2",), method="rescore").check(streams=True)
    assert DecodingConfig.of(None, hotwords=["a", "b"]).hotwords == ("a", "b")
    once = DecodingConfig(hotwords=("पणजी",), hotword_boost=2.0).resolved(streams=True)
    assert once.resolved(streams=True) == once and once.hotwords == ("पणजी",)
    # the boost by default: the CTC prefix beam's, or joint decoding's, which is more easily swayed
    assert DecodingConfig().resolved(streams=False).hotword_boost == JOINT_HOTWORD_BOOST
    for method in ("beam", "rescore"):
        assert DecodingConfig(method=method).resolved(False).hotword_boost == HOTWORD_BOOST
    assert DecodingConfig().resolved(streams=True).hotword_boost == HOTWORD_BOOST
    for settings, message in [
        (dict(hotwords=("पणजी",), method="greedy"), "--method greedy cannot be biased"),
        (dict(hotwords=("पणजी",), method="attention"), "--method attention cannot be biased"),
        (dict(hotwords="पणजी"), "a list of words or phrases"),
        (dict(hotwords=("पणजी :x",)), "--hotwords 'पणजी :x': boost 'x' is not a number"),
        (dict(hotword_boost=-1.0), "--hotword_boost must be a number >= 0"),
        (dict(hotword_boost=math.nan), "--hotword_boost"),
        (dict(hotword_boost=1e300), "--hotword_boost must be at most 100, got 1e"),
    ]:
        with pytest.raises(ConfigError, match=message):
            DecodingConfig(**settings).check()
    with pytest.raises(ConfigError, match="an ONNX export decodes without --hotwords"):
        DecodingConfig(hotwords=("पणजी",)).check(exported=True)


def test_the_prefix_beam_prunes_and_ranks_by_the_biased_score():
    """Three frames that read "ab" but could read "cb": the hotword "cb" wins with a boost that
    outweighs the difference; a hotword "cd" that only "c" begins is taken back in the end."""
    # blank, a, b, c, d (never heard)
    probs = torch.tensor([[0.1, 0.6, 0.0, 0.3, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0],
                          [0.1, 0.0, 0.9, 0.0, 0.0]]) + 1e-4
    lp = (probs / probs.sum(-1, keepdim=True)).log()
    plain = ctc_prefix_beam_search(lp, 3, beam_size=50)
    assert plain[0].tokens == [1, 2] and plain[0].hotword_bonus == 0.0
    # "cb" is half as likely (log 2 = 0.69 less); its two tokens earn 0.5 each
    boosted = ctc_prefix_beam_search(lp, 3, 50, hotword_graph=ContextGraph([([3, 2], [0.5, 0.5])]))
    assert boosted[0].tokens == [3, 2] and boosted[0].hotword_bonus == 1.0
    cb = next(h for h in plain if h.tokens == [3, 2])
    assert boosted[0].score == pytest.approx(cb.score + 1.0)
    begun = ctc_prefix_beam_search(lp, 3, 50, hotword_graph=ContextGraph([([3, 4], [2.0, 2.0])]))
    # "c" begins the hotword "cd", which no hypothesis completes: nothing kept in the end
    assert begun[0].tokens == [1, 2]
    assert all(h.hotword_bonus == (4.0 if (3, 4) in zip(h.tokens, h.tokens[1:]) else 0.0)
               for h in begun)
    search = CTCPrefixBeam(4, hotword_graph=ContextGraph([([3, 4], [2.0, 2.0])]))
    search.advance(lp[:1])
    assert search.hypotheses(final=False)[0].tokens == [3]  # a partial result keeps it
    assert search.hypotheses()[0].tokens == [1]


# The tone model: "b?d cafe" with the second letter's tone a mix of "a" and "e"
@pytest.fixture(scope="module")
def tone(tone_model):
    """The streaming tone model and an utterance it does not hear as "bed cafe" for sure: "bed
    cafe" is in the beam's n-best but not first."""
    rec = tone_model
    for share in (0.8, 0.85, 0.9, 0.95):
        wav = mixed_speech(share)
        with torch.inference_mode():
            feats = rec.frontend(wav)[None]
            enc, lens = rec.model.encode(feats, torch.tensor([feats.shape[1]]))
            nbest = ctc_prefix_beam_search(rec.model.ctc_log_probs(enc)[0], int(lens[0]), 10)
        texts = [rec.tokenizer.decode(h.tokens) for h in nbest]
        if texts[0] != "bed cafe" and "bed cafe" in texts:
            return rec, wav, share
    pytest.fail("no mix of the tones of 'a' and 'e' the tone model hears as either")


def _stream_texts(rec, wav, **settings):
    stream = rec.stream(chunk_size=4, **settings)
    results = stream.accept(wav) + stream.finish()
    return [(r.text, r.is_final, r.start, r.end) for r in results]


@pytest.mark.parametrize("method", ["beam", "rescore", "joint"])
def test_a_boosted_word_pulls_the_search_to_it(tone, method):
    rec, wav, _ = tone
    plain = rec.decode_waveforms([wav], method=method)[0]
    assert plain != "bed cafe"
    assert rec.decode_waveforms([wav], method=method, hotwords=["bed"], hotword_boost=2.0) == [
        "bed cafe"]
    # the word the audio holds more of, boosted, stays
    assert rec.decode_waveforms([wav], method=method, hotwords=["bad :2"])[0] == "bad cafe"


def test_the_largest_boost_keeps_joint_decoding_s_scores_finite(tone):
    """At ``MAX_BOOST`` joint decoding still ranks its hypotheses (1e300 overflowed float32 to
    inf, then NaN, and gave empty text; parse_hotword and the settings refuse it now). So large
    a boost writes the word wherever it can ("bed bed bed bed" with joint), as asked."""
    rec, wav, _ = tone
    for method in ("joint", "rescore", "beam"):
        [text] = rec.decode_waveforms([wav], method=method, hotwords=[f"bed :{MAX_BOOST:g}"])
        assert text.startswith("bed "), method
        assert rec.decode_waveforms([wav], method=method, hotwords=["bed"],
                                    hotword_boost=MAX_BOOST) == [text]


def test_a_boosted_word_pulls_the_stream_to_it(tone):
    rec, wav, _ = tone
    assert _stream_texts(rec, wav)[-1][0] != "bed cafe"
    assert _stream_texts(rec, wav, hotwords=["bed"], hotword_boost=2.0)[-1][0] == "bed cafe"


def test_a_boost_of_zero_changes_nothing(tone):
    """The same hypotheses, scores and results as without hotwords, exactly."""
    rec, wav, _ = tone
    zero = dict(hotwords=["bed", "cafe", "fad :0"], hotword_boost=0.0)
    for method in ("beam", "rescore", "joint"):
        assert (rec.decode_waveforms([wav, speech("ace bed fad")], method=method, **zero)
                == rec.decode_waveforms([wav, speech("ace bed fad")], method=method))
    with torch.inference_mode():
        feats = rec.frontend(wav)[None]
        enc, lens = rec.model.encode(feats, torch.tensor([feats.shape[1]]))
        lp = rec.model.ctc_log_probs(enc)[0]
    graph = context_graph(("bed", "cafe"), 0.0, rec.tokenizer)
    assert not graph.active
    plain = ctc_prefix_beam_search(lp, int(lens[0]), 10)
    assert ctc_prefix_beam_search(lp, int(lens[0]), 10, hotword_graph=graph) == plain
    for settings in ({}, {"method": "beam"}):
        assert _stream_texts(rec, wav, **settings, **zero) == _stream_texts(rec, wav, **settings)


@pytest.fixture(scope="module")
def tone_files(tone, tmp_path_factory):
    """The tone model's checkpoint, its mixed utterance, a manifest and a hotwords file."""
    rec, wav, _ = tone
    folder = tmp_path_factory.mktemp("hotword_cli")
    checkpoint = save_checkpoint({"model_config": dataclasses.asdict(rec.model.cfg),
                                  "model": rec.model.state_dict(),
                                  "tokenizer": rec.tokenizer.model_proto}, folder / "tone.pt")
    sf.write(folder / "mixed.wav", wav.numpy(), SAMPLE_RATE)
    sf.write(folder / "bad.wav", speech("bad cafe", seed=7).numpy(), SAMPLE_RATE)
    (folder / "test.jsonl").write_text("".join(
        json.dumps({"audio_filepath": name, "text": "bad cafe"}) + "\n"
        for name in ("mixed.wav", "bad.wav")))
    (folder / "hot.txt").write_text("# the word\nbed :2\n", encoding="utf-8")
    return folder, checkpoint


def test_transcribe_and_evaluate_take_a_hotwords_file(tone_files, capsys):
    folder, checkpoint = tone_files
    wav, hot = str(folder / "mixed.wav"), str(folder / "hot.txt")
    for flags in ([], ["--chunk_size", "4"]):
        assert transcribe.main([str(checkpoint), wav, "--method", "beam", *flags]) == 0
        plain = capsys.readouterr().out.splitlines()[-1].split("\t")[-1]
        assert transcribe.main([str(checkpoint), wav, "--method", "beam", "--hotwords", hot,
                                *flags]) == 0
        boosted = capsys.readouterr().out.splitlines()[-1].split("\t")[-1]
        assert plain != boosted == "bed cafe"
    # the file's own boost, or --hotword_boost for a line with none: 0 changes nothing
    (folder / "plain.txt").write_text("bed\n", encoding="utf-8")
    assert transcribe.main([str(checkpoint), wav, "--hotwords", str(folder / "plain.txt"),
                            "--hotword_boost", "0"]) == 0
    assert transcribe.main([str(checkpoint), wav]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == lines[1]
    assert evaluate.main([str(checkpoint), str(folder / "test.jsonl"), "--method", "rescore",
                          "--hotwords", hot, "--worst", "0"]) == 0
    assert "CER" in capsys.readouterr().out


@pytest.mark.parametrize("tool", [transcribe, evaluate])
def test_bad_hotword_flags_are_one_line_exit_2(tone_files, tool, capsys):
    folder, checkpoint = tone_files
    (folder / "bad.txt").write_text("bed\ncafe :much\n", encoding="utf-8")
    inputs = [str(folder / ("test.jsonl" if tool is evaluate else "mixed.wav"))]
    for flags, message in [
        (["--hotwords", str(folder / "bad.txt")],
         f"argument --hotwords: {folder / 'bad.txt'}:2: 'cafe :much': boost 'much' is not a"),
        (["--hotwords", str(folder / "none.txt")], f"{folder / 'none.txt'}: file not found"),
        (["--hotwords", str(folder / "hot.txt"), "--method", "greedy"],
         "--method greedy cannot be biased towards --hotwords"),
        (["--hotword_boost", "-2"], "--hotword_boost must be a number >= 0"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            tool.main([str(checkpoint), *inputs, *flags])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err
