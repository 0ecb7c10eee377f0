"""--init_from: a fresh run from another run's weights; --freeze_encoder_steps."""
import dataclasses
import logging
import math
import re

import pytest
import torch
from tiny_args import tiny_args

from konkanivani.checkpoint import InferenceModel, load_checkpoint, save_checkpoint
from konkanivani.cli import train as cli
from konkanivani.config import (
    INIT_MODULES,
    ModelConfig,
    TrainConfig,
    dataclass_from_args,
    model_config_from_preset,
    resolve_model_config,
)
from konkanivani.data.tokenizer import Tokenizer, train_tokenizer
from konkanivani.model.asr import ASRModel
from konkanivani.training.finetune import load_init_weights
from konkanivani.training.metrics_log import read_metrics

TEXTS = [
    "मुजें नांव राम",
    "तुजें नांव कितें",
    "हांव घरा वता",
    "आमी शाळेंत शिकतात",
    "ताणें पुस्तक वाचलें",
] * 4
SPECIALS = 3  # blank, unk, sos/eos


def _checkpoint(model: ASRModel, tokenizer: Tokenizer) -> InferenceModel:
    return InferenceModel.of({"model_config": dataclasses.asdict(model.cfg),
                              "model": model.state_dict(), "tokenizer": tokenizer.model_proto})


def _shared_pieces(old: Tokenizer, new: Tokenizer) -> dict[int, int]:
    """{new id: old id} of the non-special pieces both have, computed here, not by the code under
    test."""
    old_ids = {p: i for i, p in enumerate(old.pieces(range(old.vocab_size)))}
    return {i: old_ids[p] for i, p in enumerate(new.pieces(range(new.vocab_size)))
            if i >= SPECIALS and p in old_ids and old_ids[p] >= SPECIALS}


def test_init_modules_are_the_model_modules_with_weights():
    # self-conditioned, so that its table of one row per token is there too
    model = ASRModel(model_config_from_preset("tiny", vocab_size=37, self_condition_layer=1))
    assert set(INIT_MODULES) == {
        name for name, child in model.named_children() if list(child.parameters())
    }
    assert set(ASRModel.VOCABULARY_TENSORS) == {
        n for n, t in model.state_dict().items() if t.shape[:1] == (37,)
    }


def test_weights_load_where_they_fit_and_vocabulary_rows_follow_their_tokens():
    old_tok, new_tok = train_tokenizer(TEXTS, model_type="char"), train_tokenizer(
        TEXTS, 40, "unigram"
    )
    torch.manual_seed(0)
    old = ASRModel(model_config_from_preset("tiny", vocab_size=old_tok.vocab_size))
    new = ASRModel(model_config_from_preset("tiny", vocab_size=new_tok.vocab_size))
    fresh = {k: v.clone() for k, v in new.state_dict().items()}
    report = load_init_weights(
        new, new_tok, _checkpoint(old, old_tok), ("encoder", "ctc_head"), "old.pt"
    )

    encoder = [n for n in old.state_dict() if n.startswith("encoder.")]
    assert set(report.loaded) == set(encoder) and not report.skipped
    shared = _shared_pieces(old_tok, new_tok)
    assert 0 < len(shared) < new_tok.vocab_size - SPECIALS  # some pieces in both, not all
    assert report.resized == {"ctc_head.weight": (len(shared) + SPECIALS, new_tok.vocab_size),
                              "ctc_head.bias": (len(shared) + SPECIALS, new_tok.vocab_size)}
    got, was = new.state_dict(), old.state_dict()
    for name in report.loaded:
        assert torch.equal(got[name], was[name])
    for name in ("ctc_head.weight", "ctc_head.bias"):
        for new_id, old_id in [*shared.items(), *((i, i) for i in range(SPECIALS))]:
            assert torch.equal(got[name][new_id], was[name][old_id])
        unmatched = [i for i in range(new_tok.vocab_size) if i >= SPECIALS and i not in shared]
        # their fresh initialization
        assert torch.equal(got[name][unmatched], fresh[name][unmatched])
    for name in got:  # the decoder was not asked for; CMVN is not init_from's to load
        if name.startswith("decoder.") or name.startswith("feat_"):
            assert torch.equal(got[name], fresh[name])
    summary = report.summary()
    assert summary.startswith(
        f"init_from old.pt (training weights): loaded {len(encoder)} tensors (encoder), "
        f"resized 2 (ctc_head.weight: {len(shared) + SPECIALS} of {new_tok.vocab_size} rows "
        "matched by token"
    ), summary
    assert summary.endswith("skipped 0")


def test_the_same_tokenizer_loads_the_vocabulary_tensors_whole():
    tok = train_tokenizer(TEXTS, 30, "unigram")
    old, new = (
        ASRModel(model_config_from_preset("tiny", vocab_size=tok.vocab_size)) for _ in range(2)
    )
    report = load_init_weights(new, tok, _checkpoint(old, tok), INIT_MODULES)
    assert not report.resized and not report.skipped
    assert all(
        torch.equal(new.state_dict()[n], t)
        for n, t in old.state_dict().items()
        if not n.startswith("feat_")
    )


def test_another_width_is_skipped_and_said_not_a_crash():
    tok = train_tokenizer(TEXTS, model_type="char")
    old = ASRModel(model_config_from_preset("tiny", vocab_size=tok.vocab_size))
    new = ASRModel(model_config_from_preset("tiny", vocab_size=tok.vocab_size, d_model=32))
    report = load_init_weights(new, tok, _checkpoint(old, tok), INIT_MODULES)
    assert (
        report.skipped["ctc_head.weight"]
        == f"({tok.vocab_size}, 48) there, ({tok.vocab_size}, 32) here"
    )
    assert re.search(r"skipped \d+ \(", report.summary())
    assert len(report.loaded) + len(report.resized) + len(report.skipped) == \
        len([n for n in new.state_dict() if not n.startswith("feat_")])


@pytest.mark.parametrize(
    "content,message",
    [
        (
            b"not a checkpoint",
            "--init_from: cannot read checkpoint {path}: the file is truncated, corrupt",
        ),
        (None, "--init_from {path}: not a model checkpoint (no model_config, tokenizer)"),
    ],
)
def test_an_unusable_init_checkpoint_is_one_line_naming_it_before_any_work(
    content, message, tmp_path, caplog
):
    path = tmp_path / "init.pt"
    if content is None:
        save_checkpoint({"model": {}}, path)
    else:
        path.write_bytes(content)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("")
    with caplog.at_level(logging.ERROR, logger="konkanivani"):
        assert (
            cli.main(
                [
                    "--train_manifest",
                    str(manifest),
                    "--valid_manifest",
                    str(manifest),
                    "--output_dir",
                    str(tmp_path / "out"),
                    "--init_from",
                    str(path),
                ]
            )
            == 2
        )
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert (
        len(errors) == 1
        and len(errors[0].splitlines()) == 1
        and message.format(path=path) in errors[0]
    ), errors
    assert not (tmp_path / "out").exists()


# ---- end to end: a run that starts from another -----------------------------------------------

def _part(state, prefix):
    return {n: t for n, t in state.items() if n.startswith(prefix)}


@pytest.fixture(scope="module")
def base(tiny_corpus, tmp_path_factory):
    """Four steps of a unigram-48 run, its checkpoint copied with shifted CMVN statistics (so that
    kept and recomputed ones differ)."""
    out = tmp_path_factory.mktemp("base") / "run"
    assert cli.main(tiny_args(tiny_corpus, out, "--max_steps", "4", "--no_tensorboard")) == 0
    ckpt = load_checkpoint(out / "latest.pt")
    ckpt["model"]["feat_mean"] = ckpt["model"]["feat_mean"] + 1.0
    return save_checkpoint(
        {k: v for k, v in ckpt.items() if k != "format_version"}, out.parent / "init.pt"
    )


FINE_TUNE = ("--tokenizer_type", "char", "--freeze_encoder_steps", "2", "--save_every_steps", "1",
             "--keep_checkpoints", "5", "--no_tensorboard")


def test_a_fine_tune_loads_what_fits_holds_the_encoder_then_trains_it(
    base, tiny_corpus, tmp_path, caplog
):
    out = tmp_path / "ft"
    with caplog.at_level(logging.INFO, logger="konkanivani"):
        assert (
            cli.main(
                tiny_args(
                    tiny_corpus, out, "--init_from", str(base), "--max_steps", "3", *FINE_TUNE
                )
            )
            == 0
        )
    init = load_checkpoint(base)
    old_tok, new_tok = Tokenizer(init["tokenizer"]), Tokenizer.load(out / "tokenizer.model")
    matched = len(_shared_pieces(old_tok, new_tok)) + SPECIALS
    assert f"--init_from: model dimensions from {base} (--preset not used)" in caplog.text
    assert re.search(
        rf"init_from {re.escape(str(base))} \(training weights\): loaded \d+ tensors "
        rf"\(encoder, decoder\), resized 5 \(ctc_head\.weight: {matched} of {new_tok.vocab_size}"
        r" rows "
        r"matched by token, .*\), skipped 0$",
        caplog.text,
        re.M,
    )
    assert "step 3: the encoder trains from now on (--freeze_encoder_steps 2)" in caplog.text

    train_rows = read_metrics(out / "metrics.jsonl")["train"]
    assert [r["step"] for r in train_rows] == [1, 2, 3] and all(
        math.isfinite(r["loss"]) for r in train_rows
    )
    steps = {s: load_checkpoint(out / f"step_000000{s}.pt")["model"] for s in (1, 2, 3)}
    assert steps[3]["ctc_head.weight"].shape[0] == new_tok.vocab_size
    # the frozen steps: not a bit of the encoder moved (nor did weight decay touch it)
    for s in (1, 2):
        assert all(torch.equal(t, init["model"][n]) for n, t in _part(steps[s], "encoder.").items())
    # the heads learned
    assert not torch.equal(steps[1]["ctc_head.weight"], steps[2]["ctc_head.weight"])
    assert not torch.equal(steps[1]["decoder.output.weight"], steps[2]["decoder.output.weight"])
    assert any(not torch.equal(t, init["model"][n]) for n, t in _part(steps[3], "encoder.").items())
    # CMVN from the new training data (the base run's own), not the init checkpoint's shifted one
    base_run = load_checkpoint(base.parent / "run" / "latest.pt")["model"]
    assert torch.equal(steps[3]["feat_mean"], base_run["feat_mean"])

    # Stopped after its first step and resumed: --init_from is not applied again, the freeze holds
    split = tmp_path / "split"
    args = tiny_args(tiny_corpus, split, "--init_from", str(base), *FINE_TUNE)
    assert cli.main(args + ["--max_steps", "1"]) == 0
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="konkanivani"):
        assert cli.main(args + ["--max_steps", "3", "--resume", "latest"]) == 0
    assert f"--init_from {base} not applied: the run resumes from its own checkpoint" in caplog.text
    assert "init_from" not in caplog.text.replace(f"--init_from {base} not applied", "")
    resumed = load_checkpoint(split / "step_0000002.pt")["model"]
    assert all(torch.equal(t, init["model"][n]) for n, t in _part(resumed, "encoder.").items())
    for name, tensor in load_checkpoint(split / "latest.pt")["model"].items():
        torch.testing.assert_close(tensor, steps[3][name], rtol=1e-4, atol=1e-5)


def test_kept_cmvn_and_a_model_flag_over_the_init_dimensions(base, tiny_corpus, tmp_path, caplog):
    out = tmp_path / "narrow"
    with caplog.at_level(logging.INFO, logger="konkanivani"):
        assert (
            cli.main(
                tiny_args(
                    tiny_corpus,
                    out,
                    "--init_from",
                    str(base),
                    "--max_steps",
                    "1",
                    "--keep_init_cmvn",
                    "--d_model",
                    "32",
                    "--no_tensorboard",
                )
            )
            == 0
        )
    assert f"model dimensions from {base}, with --d_model 32 from the command line" in caplog.text
    assert re.search(r"resized 0, skipped \d+ \(", caplog.text)  # another width: nothing of it fits
    assert f"CMVN statistics: kept from {base} (--keep_init_cmvn)" in caplog.text
    ckpt = load_checkpoint(out / "latest.pt")
    assert ckpt["model_config"]["d_model"] == 32 and ckpt["model_config"]["encoder_layers"] == 2
    assert torch.equal(ckpt["model"]["feat_mean"], load_checkpoint(base)["model"]["feat_mean"])


def _resolved(argv, saved):
    """The ModelConfig train() resolves for the trainer's flags ``argv`` from the stored
    ``saved``."""
    args = cli.parse_args(argv)
    cfg = dataclass_from_args(TrainConfig, args)
    return resolve_model_config(cfg, cli.model_flags(args), saved)


def test_the_model_config_resolved_once_is_the_one_the_run_builds(base, tiny_corpus, tmp_path,
                                                                  caplog):
    """train() resolves the ModelConfig once and hands it to the run: a fresh run's from the
    --init_from checkpoint's dimensions with a flag over them; a resumed run's from its checkpoint,
    the model flags ignored with a warning."""
    out, init = tmp_path / "resolved", load_checkpoint(base)["model_config"]
    argv = tiny_args(tiny_corpus, out, "--init_from", str(base), "--max_steps", "1",
                     "--encoder_layers", "1", "--no_tensorboard")
    resolved = _resolved(argv, init)
    assert (resolved.encoder_layers, resolved.d_model) == (1, init["d_model"])
    assert resolved == dataclasses.replace(ModelConfig.from_dict(init), encoder_layers=1,
                                           vocab_size=0)
    assert cli.main(argv) == 0
    built = load_checkpoint(out / "latest.pt")["model_config"]
    vocabulary = Tokenizer.load(out / "tokenizer.model").vocab_size
    assert built == dataclasses.asdict(dataclasses.replace(resolved, vocab_size=vocabulary))

    # a run started with log-mels resumes as one under a recipe that now names kaldi_fbank
    again = tiny_args(tiny_corpus, out, "--max_steps", "2", "--resume", "latest",
                      "--encoder_layers", "3", "--d_model", "64", "--frontend", "kaldi_fbank",
                      "--no_tensorboard")
    with caplog.at_level(logging.WARNING, logger="konkanivani"):
        assert _resolved(again, built) == ModelConfig.from_dict(built)
        assert cli.main(again) == 0
    ignored = [r for r in caplog.records if "model flags ignored on resume" in r.getMessage()]
    assert len(ignored) == 2  # once by the call above, once by the run
    assert load_checkpoint(out / "latest.pt")["model_config"] == built
    assert built["frontend"] == "log_mel"
    assert load_checkpoint(out / "latest.pt")["step"] == 2
