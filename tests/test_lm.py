"""The language model and shallow fusion: each fused search against a from-scratch recomputation
of its score, on a tiny random ASR model and LM (no training), then LM training, resume and the CLI.
"""

import pytest
import torch
from test_decode import ctc_logprob  # log P(tokens | x) by torch's CTC forward algorithm

from konkanivani.config import ConfigError, model_config_from_preset
from konkanivani.data.tokenizer import SOS_EOS_ID
from konkanivani.decoding.search import (
    FUSED_METHODS,
    Fusion,
    attention_beam_search,
    attention_rescoring,
    attention_scores,
    ctc_prefix_beam_search,
)
from konkanivani.decoding.settings import DecodingConfig
from konkanivani.model.asr import ASRModel
from konkanivani.model.lm import LMConfig, TransformerLM

V = 9  # a vocabulary small enough that random models end hypotheses early and beams really differ


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    asr = ASRModel(model_config_from_preset("tiny", vocab_size=V, n_mels=20)).eval()
    lm = TransformerLM(LMConfig(vocab_size=V, d_model=32, n_heads=2, ffn_dim=64, layers=2)).eval()
    feats, feat_lens = torch.randn(3, 41, 20), torch.tensor([41, 33, 25])
    with torch.inference_mode():
        enc, enc_lens = asr.encode(feats, feat_lens)
    return asr, lm, feats, feat_lens, enc, enc_lens


@pytest.fixture(autouse=True)
def _inference():
    with torch.inference_mode():
        yield


def test_lm_step_equals_the_full_forward(models):
    _, lm, *_ = models
    sentences = [[5, 6, 7, 3], [8], []]
    full = lm.sentence_log_probs(sentences)
    for s, expected in zip(sentences, full):
        state, total = lm.init_state(), 0.0
        for tok, nxt in zip([SOS_EOS_ID, *s], [*s, SOS_EOS_ID]):
            log_p, state = lm.step(torch.tensor([tok]), state)
            total += float(log_p[0, nxt])
        assert total == pytest.approx(float(expected), abs=1e-4)
    assert lm.next_log_probs([s for s in sentences]).exp().sum(-1) == pytest.approx(1.0, abs=1e-5)
    torch.testing.assert_close(
        lm.next_log_probs([[5, 6]])[0], lm.next_log_probs([[5, 6], [8, 8, 8, 8]])[0]
    )


@pytest.mark.parametrize("ctc_weight", [0.0, 0.5])
def test_weight_zero_is_the_plain_search(models, ctc_weight):
    asr, lm, feats, feat_lens, enc, enc_lens = models
    zero = Fusion(lm, 0.0, 0.0)
    plain = attention_beam_search(asr, enc, enc_lens, beam_size=3, ctc_weight=ctc_weight)
    fused = attention_beam_search(
        asr, enc, enc_lens, beam_size=3, ctc_weight=ctc_weight, fusion=zero
    )
    assert [(h.tokens, h.score) for h in fused] == [(h.tokens, h.score) for h in plain]
    plain = attention_rescoring(asr, enc, enc_lens, beam_size=3, ctc_weight=ctc_weight)
    fused = attention_rescoring(asr, enc, enc_lens, beam_size=3, ctc_weight=ctc_weight, fusion=zero)
    assert [(h.tokens, h.score) for h in fused] == [(h.tokens, h.score) for h in plain]
    log_probs = asr.ctc_log_probs(enc)
    for b in range(enc.shape[0]):
        plain = ctc_prefix_beam_search(log_probs[b], int(enc_lens[b]), 4)
        fused = ctc_prefix_beam_search(log_probs[b], int(enc_lens[b]), 4, zero)
        assert [(h.tokens, h.score) for h in fused] == [(h.tokens, h.score) for h in plain]
    for method in FUSED_METHODS:
        assert (decode_features(asr, feats, feat_lens, method, 3, fusion=zero)
                == decode_features(asr, feats, feat_lens, method, 3))


@pytest.mark.parametrize("ctc_weight", [0.0, 0.5])
@pytest.mark.parametrize("lm_weight, bonus", [(0.6, 0.0), (1.5, 2.0)])
def test_fused_beam_and_joint_scores_equal_a_recomputation(models, ctc_weight, lm_weight, bonus):
    """Score = λ log P_ctc + (1-λ) log P_att (teacher-forced, full CTC forward) + W log P_LM(hyp +
    end)
    + B len(hyp), each part computed from scratch."""
    asr, lm, _, _, enc, enc_lens = models
    fused = attention_beam_search(asr, enc, enc_lens, beam_size=3, ctc_weight=ctc_weight,
                                  fusion=Fusion(lm, lm_weight, bonus))
    plain = attention_beam_search(asr, enc, enc_lens, beam_size=3, ctc_weight=ctc_weight)
    att = attention_scores(asr, enc, enc_lens, [h.tokens for h in fused])
    lm_lp = lm.sentence_log_probs([h.tokens for h in fused])
    log_probs = asr.ctc_log_probs(enc)
    for b, h in enumerate(fused):
        expected = (
            (1 - ctc_weight) * float(att[b]) + lm_weight * float(lm_lp[b]) + bonus * len(h.tokens)
        )
        if ctc_weight:
            expected += ctc_weight * ctc_logprob(log_probs[b], int(enc_lens[b]), h.tokens)
        assert h.score == pytest.approx(expected, abs=2e-3)
    assert [h.tokens for h in fused] != [h.tokens for h in plain] or bonus == 0  # the terms do act


def test_fused_rescoring_score_equals_a_recomputation(models):
    asr, lm, _, _, enc, enc_lens = models
    fused = attention_rescoring(
        asr, enc, enc_lens, beam_size=4, ctc_weight=0.3, fusion=Fusion(lm, 0.8, 0.5)
    )
    log_probs = asr.ctc_log_probs(enc)
    for b, h in enumerate(fused):
        nbest = ctc_prefix_beam_search(log_probs[b], int(enc_lens[b]), 4)
        ctc = next(n.score for n in nbest if n.tokens == h.tokens)
        att = float(attention_scores(asr, enc[b:b + 1], enc_lens[b:b + 1], [h.tokens])[0])
        expected = (
            0.3 * ctc
            + 0.7 * att
            + 0.8 * float(lm.sentence_log_probs([h.tokens])[0])
            + 0.5 * len(h.tokens)
        )
        assert h.score == pytest.approx(expected, abs=1e-4)


def test_fused_ctc_prefix_beam_search_without_pruning_is_exact(models):
    """With every prefix kept, each score is the CTC log P over all alignments + the fusion
    terms."""
    _, lm, *_ = models
    torch.manual_seed(1)
    log_probs = torch.randn(4, V).log_softmax(-1)
    nbest = ctc_prefix_beam_search(log_probs, 4, beam_size=100_000, fusion=Fusion(lm, 0.7, 1.2))
    assert len(nbest) > 500 and [h.score for h in nbest] == sorted(
        (h.score for h in nbest), reverse=True
    )
    lm_lp = lm.sentence_log_probs([h.tokens for h in nbest])
    for h, lp in zip(nbest, lm_lp.tolist()):
        assert h.score == pytest.approx(
            ctc_logprob(log_probs, 4, h.tokens) + 0.7 * lp + 1.2 * len(h.tokens), abs=1e-4
        )


def test_a_fused_search_fed_piece_by_piece_with_partial_results_equals_one_pass(models):
    from konkanivani.decoding.search import CTCPrefixBeam

    asr, lm, _, _, enc, enc_lens = models
    log_probs = asr.ctc_log_probs(enc)[0, :int(enc_lens[0])]
    fusion = Fusion(lm, 0.5, 0.8)
    stream = CTCPrefixBeam(4, fusion)
    for start in range(0, log_probs.shape[0], 3):
        stream.advance(log_probs[start:start + 3])
        stream.hypotheses()  # a partial result on the way changes nothing
    assert stream.hypotheses() == ctc_prefix_beam_search(log_probs, log_probs.shape[0], 4, fusion)


def test_greedy_refuses_fusion():
    with pytest.raises(ConfigError, match="--method greedy takes no --lm"):
        DecodingConfig(method="greedy", lm_weight=0.3).check(lm_loaded=True)


# ---- training on text ---------------------------------------------------------------------------

import logging  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from decode_helpers import decode_features  # noqa: E402

from konkanivani.checkpoint import CheckpointError  # noqa: E402
from konkanivani.cli import train_lm  # noqa: E402
from konkanivani.data.tokenizer import Tokenizer, train_tokenizer  # noqa: E402
from konkanivani.model.lm import check_same_vocabulary, load_lm  # noqa: E402
from konkanivani.training import lm_training  # noqa: E402
from konkanivani.training.metrics_log import read_metrics  # noqa: E402

SENTENCES = (
    Path(__file__).resolve().parents[1] / "konkanivani" / "resources" / "demo_sentences_kok.txt"
)
TINY = [
    "--d_model",
    "32",
    "--layers",
    "1",
    "--n_heads",
    "2",
    "--batch_size",
    "16",
    "--warmup_steps",
    "5",
    "--lr",
    "3e-3",
    "--device",
    "cpu",
    "--valid_every",
    "4",
]


@pytest.fixture(scope="module")
def text_setup(tmp_path_factory):
    """200 sentences with blank lines among them, a tokenizer file, and a second, different
    tokenizer."""
    d = tmp_path_factory.mktemp("lm_text")
    lines = SENTENCES.read_text(encoding="utf-8").splitlines()[:200]
    (d / "text.txt").write_text(
        "\n".join(lines[:100] + ["", "   ।  "] + lines[100:]) + "\n\n", encoding="utf-8"
    )
    train_tokenizer(lines, vocab_size=60).save(d / "tok.model")
    train_tokenizer(lines, vocab_size=70).save(d / "other.model")
    return d


def _train(d: Path, out: str, *flags: str) -> dict:
    with torch.inference_mode(False):
        args = train_lm.parse_args(
            [
                str(d / "text.txt"),
                "--tokenizer",
                str(d / "tok.model"),
                "--output_dir",
                str(d / out),
                *TINY,
                *flags,
            ]
        )
        return lm_training.train_lm(*train_lm.configs(args))


def test_read_sentences_counts_blank_lines_and_names_bad_text(text_setup, tmp_path):
    tok = Tokenizer.load(text_setup / "tok.model")
    sentences, blank = lm_training.read_sentences([text_setup / "text.txt"], tok)
    assert len(sentences) == 200 and blank == 3
    bad = tmp_path / "bad.txt"
    bad.write_bytes("ठीक\nठीक\n".encode() + b"\xff\xfe\n")
    with pytest.raises(lm_training.TextError, match=rf"^{bad}:3: not UTF-8 text$"):
        lm_training.read_sentences([bad], tok)


def test_lm_learns_and_resume_is_exact(text_setup, caplog):
    """Validation perplexity drops by a third over 20 steps; 10 steps then a resume to 24 give the
    unbroken run's losses, with the checkpoint's split even when the resume asks for another (and
    the log says that split).
    """
    d = text_setup
    caplog.set_level(logging.INFO, logger="konkanivani")
    whole = _train(d, "whole", "--max_steps", "24")
    split_line = next(r.getMessage() for r in caplog.records if "for validation" in r.getMessage())
    ppl = [r["ppl"] for r in read_metrics(d / "whole" / "metrics.jsonl")["valid"]]
    assert whole["step"] == 24 and ppl[-1] < 0.7 * ppl[0]
    assert _train(d, "broken", "--max_steps", "10")["stopped_by"] == "max_steps"
    caplog.clear()
    _train(d, "broken", "--max_steps", "24", "--resume", "latest", "--valid_fraction", "0.5")
    assert [r.getMessage() for r in caplog.records if "for validation" in r.getMessage()] == [
        split_line
    ]
    assert [r["loss"] for r in read_metrics(d / "broken" / "metrics.jsonl")["train"]] == [
        r["loss"] for r in read_metrics(d / "whole" / "metrics.jsonl")["train"]
    ]
    a, b = load_lm(d / "whole" / "latest.pt")[0], load_lm(d / "broken" / "latest.pt")[0]
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


def test_vocabulary_mismatch_is_one_line_naming_both_files(text_setup):
    lm_tok = Tokenizer.load(text_setup / "tok.model")
    check_same_vocabulary(lm_tok, "lm.pt", Tokenizer.load(text_setup / "tok.model"), "asr.pt")
    with pytest.raises(CheckpointError) as e:
        check_same_vocabulary(lm_tok, "lm.pt", Tokenizer.load(text_setup / "other.model"), "asr.pt")
    assert "\n" not in str(e.value) and "lm.pt" in str(e.value) and "asr.pt" in str(e.value)


@pytest.mark.slow
def test_cli_end_to_end(text_setup, tmp_path, caplog, capsys):
    """The console script's module as a subprocess: trains, saves, is refused a second fresh start,
    and its checkpoint fuses into decoding."""
    d = text_setup
    cmd = [
        sys.executable,
        "-m",
        "konkanivani.cli.train_lm",
        str(d / "text.txt"),
        "--tokenizer",
        str(d / "tok.model"),
        "--output_dir",
        str(tmp_path / "lm"),
        "--valid_text",
        str(d / "text.txt"),
        "--max_steps",
        "3",
        *TINY,
    ]
    done = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert "step 3: validation perplexity" in done.stdout and "3 blank lines skipped" in done.stderr
    assert {"latest.pt", "best.pt", "metrics.jsonl"} <= {
        p.name for p in (tmp_path / "lm").iterdir()
    }
    assert train_lm.main(cmd[3:]) == 2  # in-process from here on
    assert "already holds a run" in caplog.text
    assert (
        train_lm.main([str(tmp_path / "nope.txt"), *cmd[4:6], "--output_dir", str(tmp_path / "x")])
        == 2
    )
    assert f"{tmp_path / 'nope.txt'}: file not found" in caplog.text
    # ...and its checkpoint fuses into konkanivani-transcribe, whose ASR checkpoint must share its
    # tokenizer.
    import soundfile

    from konkanivani.checkpoint import save_checkpoint
    from konkanivani.cli import transcribe

    soundfile.write(tmp_path / "noise.wav", 0.1 * torch.randn(16000).numpy(), 16000)
    for name, tok in (("asr.pt", "tok.model"), ("other_asr.pt", "other.model")):
        tokenizer = Tokenizer.load(d / tok)
        asr = ASRModel(model_config_from_preset("tiny", vocab_size=tokenizer.vocab_size))
        save_checkpoint({"model_config": vars(asr.cfg), "tokenizer": tokenizer.model_proto,
                         "model": asr.state_dict()}, tmp_path / name)
    lm_flags = [
        "--method",
        "joint",
        "--beam_size",
        "2",
        "--lm",
        str(tmp_path / "lm" / "best.pt"),
        "--lm_weight",
        "0.5",
        "--length_bonus",
        "0.5",
        "--device",
        "cpu",
    ]
    with torch.inference_mode(False):
        assert (
            transcribe.main([str(tmp_path / "asr.pt"), str(tmp_path / "noise.wav"), *lm_flags]) == 0
        )
        caplog.clear()
        assert (
            transcribe.main(
                [str(tmp_path / "other_asr.pt"), str(tmp_path / "noise.wav"), *lm_flags]
            )
            == 2
        )
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: language model") and str(tmp_path / "other_asr.pt") in err
    assert str(tmp_path / "lm" / "best.pt") in err
    with pytest.raises(SystemExit) as e:
        transcribe.main(
            [
                str(tmp_path / "asr.pt"),
                str(tmp_path / "noise.wav"),
                *lm_flags[:-2],
                "--method",
                "greedy",
            ]
        )
    assert e.value.code == 2 and "takes no --lm" in capsys.readouterr().err


# The fields every run has (config.RunConfig), each with a value both trainers must refuse.
SHARED_BAD = [["--epochs", "0"], ["--keep_checkpoints", "0"], ["--max_steps", "-1"], ["--lr", "0"],
              ["--weight_decay", "-0.1"], ["--max_time", "-5"], ["--device", "gpu"],
              ["--resume", "nowhere.pt"], ["--resume", "latest", "--overwrite"]]


@pytest.mark.parametrize("bad", SHARED_BAD, ids=[" ".join(f) for f in SHARED_BAD])
def test_both_trainers_refuse_a_bad_shared_value_with_the_same_line(bad, text_setup, tmp_path,
                                                                    caplog):
    """One definition and one check of each RunConfig field: the ASR trainer and the LM trainer
    refuse the same bad value in the same words, before any work."""
    from konkanivani.cli import train as asr_train

    manifest = tmp_path / "m.jsonl"
    manifest.write_text("")
    asr = ["--train_manifest", str(manifest), "--valid_manifest", str(manifest), "--output_dir",
           str(tmp_path / "asr"), *bad]
    lm = [str(text_setup / "text.txt"), "--tokenizer", str(text_setup / "tok.model"),
          "--output_dir", str(tmp_path / "lm"), *bad]
    said = []
    for main, argv in ((asr_train.main, asr), (train_lm.main, lm)):
        caplog.clear()
        with torch.inference_mode(False):
            assert main(argv) == 2
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(errors) == 1 and len(errors[0].splitlines()) == 1, errors
        said.append(errors[0])
    assert said[0] == said[1] and bad[0] in said[0]
    assert not (tmp_path / "asr").exists() and not (tmp_path / "lm").exists()
