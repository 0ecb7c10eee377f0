"""Nothing lost, nothing mislabeled: long input decoded at a bounded cost, too-short or failing
files as per-file errors. On a random-init tiny model (no training), counted in decoder calls, never
timed."""

import json
import logging

import numpy as np
import pytest
import soundfile as sf
import torch
from decode_helpers import decode_features  # noqa: E402

from konkanivani.config import model_config_from_preset
from konkanivani.data.frames import SAMPLE_RATE, frames_of
from konkanivani.data.tokenizer import BLANK_ID, SOS_EOS_ID, train_tokenizer
from konkanivani.decoding import recognizer as inference
from konkanivani.decoding import search as decode
from konkanivani.decoding.evaluation import evaluate_manifest, markdown_report
from konkanivani.decoding.recognizer import MIN_SAMPLES, Recognizer
from konkanivani.decoding.search import (
    LONG_INPUT_METHOD,
    LONG_INPUT_SECONDS,
    MAX_LEN_EXTRA,
    attention_beam_search,
)
from konkanivani.model.asr import ASRModel

SENTENCES = ["हांव घरा वता", "तुमी म्हाका कित्याक सांगलें ना",
             "ह्या कपड्याचें मोल कितलें"]


@pytest.fixture(scope="module")
def recognizer():
    tokenizer = train_tokenizer(SENTENCES, vocab_size=32, model_type="char")
    torch.manual_seed(0)
    model = ASRModel(model_config_from_preset("tiny", vocab_size=tokenizer.vocab_size))
    return Recognizer(model, tokenizer, torch.device("cpu"))


@pytest.fixture
def calls(recognizer, monkeypatch):
    """Counts of the attention decoder's incremental steps and full (teacher-forced) forwards."""
    counts = {"step": 0, "forward": 0}
    decoder = recognizer.model.decoder
    for name in counts:
        original = getattr(decoder, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(decoder, name, counted)
    return counts


def feats_of(seconds: float, seed: int = 0) -> torch.Tensor:
    """Random log-mel-like features of ``seconds`` of audio, ``(T, 80)``."""
    return torch.randn(frames_of(seconds), 80, generator=torch.Generator().manual_seed(seed))


def batch(*seconds: float) -> tuple[torch.Tensor, torch.Tensor]:
    feats = [feats_of(s, seed=i) for i, s in enumerate(seconds)]
    return torch.nn.utils.rnn.pad_sequence(feats, batch_first=True), torch.tensor(
        [len(f) for f in feats]
    )


@pytest.mark.parametrize("method", ["joint", "attention", "rescore"])
def test_an_utterance_over_the_bound_is_decoded_with_ctc_beam_search(recognizer, calls, method):
    feats, lens = batch(LONG_INPUT_SECONDS + 0.5)
    with torch.inference_mode():
        got = decode_features(recognizer.model, feats, lens, method, beam_size=3)
        assert calls == {"step": 0, "forward": 0}  # the attention decoder never ran
        assert got == decode_features(recognizer.model, feats, lens, LONG_INPUT_METHOD, beam_size=3)
    assert decode.method_for(method, int(lens[0])) == LONG_INPUT_METHOD
    # up to the bound: as asked
    assert decode.method_for(method, frames_of(LONG_INPUT_SECONDS)) == method
    assert decode.method_for("greedy", int(lens[0])) == "greedy"


def test_a_batch_mixing_short_and_long_decodes_each_as_it_would_alone(recognizer, calls):
    feats, lens = batch(2.0, LONG_INPUT_SECONDS + 0.5, 1.5)
    with torch.inference_mode():
        together = decode_features(recognizer.model, feats, lens, "joint", beam_size=3)
        assert calls["step"] > 0
        for b, method in enumerate(["joint", LONG_INPUT_METHOD, "joint"]):
            alone = decode_features(
                recognizer.model, feats[b : b + 1, : lens[b]], lens[b : b + 1], method, beam_size=3
            )
            assert together[b] == alone[0]


@pytest.fixture
def silent_ctc_endless_decoder(recognizer):
    """The recognizer's model with a CTC head that only ever says blank and a decoder that never
    says the end symbol: only a length limit stops an attention search."""
    model = recognizer.model
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.ctc_head.weight.zero_()
        model.ctc_head.bias.fill_(-10.0)
        model.ctc_head.bias[BLANK_ID] = 10.0
        model.decoder.output.bias[SOS_EOS_ID] = -1e4
    yield model
    model.load_state_dict(saved)


@pytest.mark.parametrize("method", ["joint", "attention"])
def test_the_attention_search_stops_where_the_ctc_evidence_does(
    silent_ctc_endless_decoder, calls, method
):
    model = silent_ctc_endless_decoder
    feats, lens = batch(3.0)
    with torch.inference_mode():
        [tokens] = decode_features(model, feats, lens, method, beam_size=2)
        # greedy CTC: no token
        assert calls["step"] == MAX_LEN_EXTRA + 1 and len(tokens) <= MAX_LEN_EXTRA
        calls["step"] = 0
        enc, enc_lens = model.encode(feats, lens)
        # called directly: to the encoder length
        attention_beam_search(model, enc, enc_lens, beam_size=2)
        assert calls["step"] == int(enc_lens[0]) + 1 > MAX_LEN_EXTRA + 1


def write_wav(path, seconds: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    sf.write(
        path,
        (0.1 * rng.standard_normal(round(seconds * SAMPLE_RATE))).astype(np.float32),
        SAMPLE_RATE,
    )
    return path


@pytest.mark.parametrize("batch_size", [1, 8])
def test_a_too_short_file_is_its_own_error(recognizer, tmp_path, batch_size):
    normal, tiny = write_wav(tmp_path / "normal.wav", 1.0), write_wav(tmp_path / "tiny.wav", 0.04)
    edge = write_wav(tmp_path / "edge.wav", MIN_SAMPLES / SAMPLE_RATE)  # just long enough
    out = list(recognizer.transcribe([normal, tiny, edge], method="joint", beam_size=2,
                                     batch_size=batch_size))
    assert [tr.error is None for tr in out] == [True, False, True]
    assert out[1].error == f"{tiny}: audio too short (0.040 s; the model needs at least 0.060 s)"
    assert out[1].duration == pytest.approx(0.04) and out[1].text == ""
    assert out[0].method == out[2].method == "joint"


def test_a_file_that_fails_to_decode_takes_no_other_with_it(recognizer, tmp_path, monkeypatch):
    paths = [write_wav(tmp_path / f"{i}.wav", 1.0 + 0.1 * i, seed=i) for i in range(3)]
    poison = frames_of(1.1)  # the feature frames of 1.wav
    real = inference.decode_encoded

    def failing(model, enc, enc_lens, lens, *args, **kwargs):
        if poison in lens.tolist():
            raise RuntimeError("boom\nsecond line")
        return real(model, enc, enc_lens, lens, *args, **kwargs)

    monkeypatch.setattr(inference, "decode_encoded", failing)
    out = list(recognizer.transcribe(paths, method="greedy", batch_size=8))
    assert [tr.error for tr in out] == [
        None,
        f"{paths[1]}: decoding failed (RuntimeError: boom)",
        None,
    ]


def test_long_files_are_said_once_per_call(recognizer, tmp_path, caplog):
    short = write_wav(tmp_path / "short.wav", 1.0)
    longs = [write_wav(tmp_path / f"long{i}.wav", LONG_INPUT_SECONDS + 1, seed=i) for i in range(2)]
    with caplog.at_level(logging.WARNING, logger="konkanivani"):
        out = list(recognizer.transcribe([longs[0], short, longs[1]], method="joint", beam_size=2,
                                         batch_size=1))
    assert [tr.method for tr in out] == [LONG_INPUT_METHOD, "joint", LONG_INPUT_METHOD]
    [note] = [r.getMessage() for r in caplog.records if "longer than" in r.getMessage()]
    assert f"2 inputs longer than {LONG_INPUT_SECONDS:g} s decoded with {LONG_INPUT_METHOD}" in note
    assert str(longs[0]) in note and str(longs[1]) in note and str(short) not in note
    assert "--method greedy" in note


def test_evaluate_scores_what_it_could_and_says_what_decoded_it(recognizer, tmp_path):
    rows = [
        {"audio_filepath": str(write_wav(tmp_path / name, seconds)), "text": "हांव घरा वता"}
        for name, seconds in [
            ("long.wav", LONG_INPUT_SECONDS + 1),
            ("short.wav", 1.0),
            ("tiny.wav", 0.04),
        ]
    ]
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8"
    )
    result = evaluate_manifest(recognizer, manifest, method="joint", beam_size=2)
    assert [u.method for u in result.utterances] == [
        LONG_INPUT_METHOD,
        "joint",
    ] and result.long_inputs == 1
    assert result.failed == [
        (
            f"{manifest}:3",
            f"{tmp_path / 'tiny.wav'}: audio too short (0.040 s; the model needs at least 0.060 s)",
        )
    ]
    assert (
        f"decoding `joint` (1 utterance over {LONG_INPUT_SECONDS:g} s with `{LONG_INPUT_METHOD}`)"
        in markdown_report(result, "ckpt")
    )
