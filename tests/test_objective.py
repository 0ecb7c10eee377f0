"""The training objective (training/objective.py): the loss terms' weights and ramps as pure
functions of the step, SpecAugment's policy, one definition for training and validation, and every
term reported by a real run."""
import copy
import json

import pytest
import torch
from tiny_args import tiny_args

from konkanivani.cli import train as cli
from konkanivani.config import TrainConfig, model_config_from_preset
from konkanivani.model.asr import ASRModel, SpecAugment
from konkanivani.training.objective import Objective, StepWeights


def _batch():
    torch.manual_seed(1)
    return (torch.randn(2, 160, 80), torch.tensor([160, 120]),
            torch.tensor([[5, 6, 7, 8], [9, 10, 11, -1]]), torch.tensor([4, 3]))


def _objective(**flags):
    cfg = TrainConfig(train_manifest="t", valid_manifest="v", **flags)
    return Objective.from_config(cfg, encoder_layers=6)


def test_the_loss_weights_ramp_in_a_straight_line_then_stay():
    plain = _objective(ctc_weight=0.5, label_smoothing=0.1)
    assert plain.at(0) == StepWeights(0.5, 0.1, 0.0, 1.0)  # no ramp
    ramped = _objective(ctc_weight=0.5, label_smoothing=0.1, ctc_weight_from=0.9,
                        loss_ramp_steps=100)
    assert ramped.at(0)[:2] == (0.9, 0.1)  # smoothing not ramped
    assert ramped.at(50).ctc == pytest.approx(0.7)
    assert ramped.at(100) == ramped.at(5000) == plain.at(0)
    both = _objective(ctc_weight=0.5, label_smoothing=0.1, ctc_weight_from=0.9,
                      label_smoothing_from=0.0, loss_ramp_steps=100)
    assert both.at(25)[:2] == pytest.approx((0.8, 0.025))


def test_spec_augment_is_the_objectives_and_its_widths_grow_with_the_step():
    assert _objective(spec_augment=False).spec_augment is None
    objective = _objective(spec_augment=True, spec_freq_width=20, spec_time_width=30,
                           spec_augment_ramp_steps=10)
    masks = objective.spec_augment
    assert isinstance(masks, SpecAugment)
    model = ASRModel(model_config_from_preset("tiny", vocab_size=40)).train()
    widths = []
    for step in (0, 5, 10, 99):
        objective(model, *_batch(), step=step)
        widths.append((masks.freq_masks[0].mask_param, masks.time_masks[0].mask_param))
    assert widths == [(0, 0), (10, 15), (20, 30), (20, 30)]
    masks.set_scale(0.0)  # at width 0 the features go through unmasked
    x = torch.randn(2, 50, 80)
    assert torch.equal(masks(x), x)


def test_the_model_returns_unweighted_terms_and_the_objective_weighs_them():
    model = ASRModel(model_config_from_preset("tiny", vocab_size=40)).train()
    torch.manual_seed(0)
    terms = model(*_batch(), label_smoothing=0.2)
    objective = _objective(ctc_weight=0.4, label_smoothing=0.2, spec_augment=False)
    torch.manual_seed(0)
    losses = objective(model, *_batch())
    assert torch.equal(losses.ctc, terms.ctc) and torch.equal(losses.attention, terms.attention)
    assert torch.equal(losses.loss, 0.4 * terms.ctc + 0.6 * terms.attention)
    assert set(losses.named()) == {"loss", "ctc", "attention"}
    # the label smoothing is the objective's: another one changes the attention term alone
    torch.manual_seed(0)
    other = model(*_batch(), label_smoothing=0.0)
    assert torch.equal(other.ctc, terms.ctc) and not torch.equal(other.attention, terms.attention)


def test_validation_scores_the_training_weights_and_their_copy_by_one_definition():
    """A copy of the model made before training (as the moving average is) is validated with the
    weights of the step, not with those it was copied with: one definition for both."""
    model = ASRModel(model_config_from_preset("tiny", vocab_size=40)).eval()
    average = copy.deepcopy(model)
    objective = _objective(ctc_weight=0.5, ctc_weight_from=0.9, loss_ramp_steps=100)
    feats, lens, tokens, token_lens = _batch()
    enc, enc_lens = model.encode(feats, lens)
    for step in (1, 51, 500):
        raw = objective.validation(model, enc, enc_lens, tokens, token_lens, step)
        copied = objective.validation(average, enc, enc_lens, tokens, token_lens, step)
        assert torch.equal(raw.loss, copied.loss)
        w = objective.at(step - 1).ctc  # the update that made the weights at this step
        assert torch.equal(raw.loss, w * raw.ctc + (1.0 - w) * raw.attention)
    assert objective.at(50).ctc == pytest.approx(0.7)


def test_a_run_reports_every_term_in_its_log_and_metrics(tiny_corpus, tmp_path, caplog):
    out = tmp_path / "run"
    caplog.set_level("INFO", logger="konkanivani")
    code = cli.main(tiny_args(tiny_corpus, out, "--inter_ctc_weight", "0.3", "--max_steps", "4",
                              "--log_every", "2", "--validate_every_steps", "4"))
    assert code == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    valid = [r for r in rows if r["kind"] == "valid"]
    assert train and all({"loss", "ctc", "attention", "inter_ctc"} <= set(r) for r in train)
    assert valid and all({"loss", "ctc", "attention"} <= set(r) for r in valid)
    # the weighted loss is the objective's sum of the terms (the recipe's default CTC weight)
    for r in train:
        w = 0.3
        want = w * r["ctc"] + (1 - w) * r["attention"] + w * 0.3 * (r["inter_ctc"] - r["ctc"])
        assert r["loss"] == pytest.approx(want, rel=1e-4)
    assert "inter-CTC" in caplog.text
