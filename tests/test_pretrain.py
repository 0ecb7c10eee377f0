"""Pretraining the encoder on audio alone (``konkanivani-train --pretrain``, issue 54): masked
prediction of random-projection codes on manifests without text learns (the validation's masked loss
falls from where it starts and below the codebook's chance level), resumes exactly, says what its
checkpoint is, and hands its encoder to a fine-tune with --init_from."""
from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from tiny_args import tiny_args

from konkanivani.checkpoint import CheckpointError, load_checkpoint
from konkanivani.cli import train as cli
from konkanivani.decoding.recognizer import Recognizer

CODES = 64
PRETRAIN = ["--pretrain", "--codebook_size", str(CODES), "--mask_prob", "0.03",
            "--mask_span", "10", "--validate_every_steps", "10", "--lr", "3e-3"]


@pytest.fixture(scope="module")
def audio_only(tiny_corpus, tmp_path_factory):
    """The tiny corpus's manifests without their text (absolute audio paths)."""
    folder = tmp_path_factory.mktemp("audio_only")
    for name in ("train", "valid"):
        rows = [json.loads(line) for line in (tiny_corpus / f"{name}.jsonl").read_text(
            encoding="utf-8").splitlines()]
        (folder / f"{name}.jsonl").write_text("".join(
            json.dumps({"audio_filepath": str(tiny_corpus / r["audio_filepath"]),
                        "duration": r["duration"]}) + "\n" for r in rows), encoding="utf-8")
    return folder


def _rows(out, kind):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


@pytest.mark.slow
def test_pretraining_on_audio_alone_learns_resumes_and_hands_its_encoder_on(
        audio_only, tiny_corpus, tmp_path, caplog):
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert cli.main(tiny_args(audio_only, whole, *PRETRAIN, "--max_steps", "40")) == 0
    valid = _rows(whole, "valid")
    masked = [r["masked"] for r in valid]
    assert len(masked) >= 4 and all("cer" not in r for r in valid)
    # learns: below where it started, and below what knowing nothing scores
    assert masked[-1] < masked[0] - 0.3 and masked[-1] < math.log(CODES) - 0.3, masked
    train = _rows(whole, "train")
    assert [r["step"] for r in train] == list(range(1, 41))
    assert all("masked" in r and "ctc" not in r for r in train)

    # resumes exactly: stopped at step 16, resumed to 40, the same losses step by step
    assert cli.main(tiny_args(audio_only, split, *PRETRAIN, "--max_steps", "16")) == 0
    assert cli.main(tiny_args(audio_only, split, *PRETRAIN, "--max_steps", "40",
                              "--resume", "latest")) == 0
    for a, b in zip(_rows(split, "train"), train, strict=True):
        assert a["step"] == b["step"] and a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a, b)
    resumed = {r["step"]: r["masked"] for r in _rows(split, "valid")}
    unbroken = {r["step"]: r["masked"] for r in valid}
    assert len(set(resumed) & set(unbroken)) >= 4
    for step in set(resumed) & set(unbroken):  # the same masks at each validation
        assert resumed[step] == pytest.approx(unbroken[step], rel=1e-5), step

    # the checkpoint says what it is: a recognizer refuses it, naming the way on
    best = whole / "best.pt"
    saved = load_checkpoint(best)
    assert saved["model_config"]["codebook_size"] == CODES
    assert {"quantizer.projection", "quantizer.codebook"} <= set(saved["model"])
    with pytest.raises(CheckpointError, match="pretrained encoder.*--init_from"):
        Recognizer.from_checkpoint(best)

    # a fine-tune on transcribed audio starts from its encoder, with fresh heads of text
    tuned = tmp_path / "tuned"
    with caplog.at_level(logging.INFO, logger="konkanivani"):
        assert cli.main(tiny_args(tiny_corpus, tuned, "--init_from", str(best),
                                  "--max_steps", "2")) == 0
    assert "a pretrained encoder (--pretrain); its encoder is loaded" in caplog.text
    model = load_checkpoint(tuned / "latest.pt")
    assert model["model_config"]["codebook_size"] == 0
    assert not any(k.startswith(("quantizer.", "masked_head.")) for k in model["model"])
    Recognizer.from_checkpoint(tuned / "latest.pt")  # an ASR model again


def test_pretraining_refuses_what_it_has_no_use_for(audio_only, tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(tiny_args(audio_only, out, *PRETRAIN, "--inter_ctc_weight", "0.3")) == 2
    assert "--inter_ctc_weight is a CTC term; --pretrain has no transcripts" in \
        capsys.readouterr().err
    assert cli.main(tiny_args(audio_only, out, *PRETRAIN, "--self_condition_layer", "1")) == 2
    assert "without --time_reduce_layer or --self_condition_layer" in capsys.readouterr().err
    assert not out.exists()


def test_a_masked_prediction_step_moves_the_encoder_and_nothing_of_text():
    """One model forward of masked prediction: gradients reach the encoder and the masked head,
    none the CTC head or the decoder (which pretraining freezes), and the count of masked frames
    is what the loss sums over."""
    from konkanivani.config import model_config_from_preset
    from konkanivani.model.asr import ASRModel, Masking

    torch.manual_seed(0)
    model = ASRModel(model_config_from_preset("tiny", vocab_size=8, codebook_size=CODES))
    feats = torch.randn(2, 200, 80)
    terms = model(feats, torch.tensor([200, 120]), torch.zeros(2, 0, dtype=torch.long),
                  torch.zeros(2, dtype=torch.long),
                  masking=Masking(0.05, 10, torch.Generator().manual_seed(1)))
    assert terms.ctc is None and terms.attention is None and int(terms.masked_frames) > 0
    per_frame = float(terms.masked.detach()) / int(terms.masked_frames)
    assert abs(per_frame - math.log(CODES)) < 1.5  # untrained: near chance
    terms.masked.backward()
    assert model.masked_head.weight.grad is not None
    assert all(p.grad is not None for p in model.encoder.blocks.parameters())
    assert model.ctc_head.weight.grad is None and model.decoder.embed.weight.grad is None
