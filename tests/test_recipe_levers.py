"""The recipe levers of the learning benchmark (intermediate CTC, the augmentation curriculum):
each trains for real on tiny speech, learns and resumes exactly; benchmarks/recipe_levers.py's
table and flags."""
import dataclasses
import json
import logging
import sys
from pathlib import Path

import pytest
import torch
import torchaudio
from tiny_args import tiny_args

from konkanivani.cli import train as cli
from konkanivani.config import (
    ADDED_OFF,
    AugmentConfig,
    ConfigError,
    ModelConfig,
    model_config_from_preset,
    time_reduced_blocks,
)
from konkanivani.data.augment import Augmenter
from konkanivani.data.samplers import LengthCurriculum, LengthGroupedBatchSampler, train_sampler
from konkanivani.model.asr import ASRModel, SpecAugment
from konkanivani.training.objective import Objective

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import recipe_levers  # noqa: E402


def _batch():
    torch.manual_seed(1)
    return (torch.randn(2, 160, 80), torch.tensor([160, 120]),
            torch.tensor([[5, 6, 7, 8], [9, 10, 11, -1]]), torch.tensor([4, 3]))


def test_intermediate_ctc_off_is_the_model_as_before_and_on_adds_the_middle_blocks_ctc():
    cfg = model_config_from_preset("tiny", vocab_size=40)
    torch.manual_seed(0)
    model = ASRModel(cfg).train()  # intermediate CTC is a loss term: no parameters of its own
    inter = Objective(inter_ctc_weight=0.5, encoder_layers=cfg.encoder_layers)
    assert inter.inter_ctc_layer == cfg.encoder_layers // 2
    torch.manual_seed(2)
    a = Objective()(model, *_batch())
    torch.manual_seed(2)
    b = inter(model, *_batch())
    # the final CTC and attention losses are the same; the total mixes in the middle block's CTC
    assert torch.equal(a.ctc, b.ctc) and torch.equal(a.attention, b.attention)
    assert a.inter_ctc is None and b.inter_ctc is not None
    assert not torch.equal(a.loss, b.loss)
    assert torch.equal(b.loss, a.loss + 0.3 * 0.5 * (b.inter_ctc - b.ctc))
    b.loss.backward()
    first_block = model.encoder.blocks[0]
    assert all(p.grad is not None for p in first_block.parameters() if p.requires_grad)
    # evaluation has no tap: the model's terms in eval mode are the plain ones
    model.eval()
    assert model(*_batch(), tap=1).inter_ctc is None
    with pytest.raises(ConfigError, match="--inter_ctc_layer 2: the encoder's blocks are 1 to 2"):
        Objective(inter_ctc_weight=0.5, inter_ctc_layer=2, encoder_layers=cfg.encoder_layers)


def test_time_reduction_halves_the_middle_blocks_frames_and_gives_the_full_rate_back():
    cfg = model_config_from_preset("small", vocab_size=40, time_reduce_layer=2)
    assert time_reduced_blocks(cfg) == (2, 5)
    torch.manual_seed(0)
    model = ASRModel(cfg).eval()
    plain = ASRModel(model_config_from_preset("small", vocab_size=40)).eval()
    feats, lens = torch.randn(2, 401, 80), torch.tensor([401, 250])
    out, out_lens = model.encoder(feats, lens)
    assert out.shape == plain.encoder(feats, lens)[0].shape and out_lens.tolist() == [99, 61]
    # the padding changes nothing: the shorter utterance alone gives its row
    alone, _ = model.encoder(feats[1:, :250], lens[1:])
    torch.testing.assert_close(alone[0], out[1, :61], atol=1e-5, rtol=1e-5)
    # a tap inside the halved blocks (the middle one, 3) is brought back to the full rate
    _, _, tapped = model.encoder.forward_tapped(feats, lens, tap=3)
    assert tapped.shape == out.shape
    calls = []
    block = model.encoder.blocks[3]
    hook = block.register_forward_hook(lambda m, i, o: calls.append(o[0].shape[1]))
    model.encoder(feats, lens)
    hook.remove()
    assert calls == [50]  # 99 frames halved, rounded up
    Objective(inter_ctc_weight=0.3, encoder_layers=6)(
        model.train(), feats, lens, torch.tensor([[5, 6, 7], [8, 9, -1]]),
        torch.tensor([3, 2])).loss.backward()
    assert model.encoder.time_reduce.weight.grad is not None


@pytest.mark.parametrize("flags, message", [
    (dict(time_reduce_layer=6), "want 1 <= reduce < recover <= --encoder_layers 6"),
    (dict(time_reduce_layer=2, time_recover_layer=2), "want 1 <= reduce < recover"),
    (dict(time_recover_layer=4), "want 1 <= reduce < recover"),
    (dict(time_reduce_layer=2, causal_conv=True), "--time_reduce_layer is for full-context"),
    (dict(time_reduce_layer=2, dynamic_chunk=True), "--time_reduce_layer is for full-context"),
])
def test_a_time_reduction_the_encoder_cannot_run_is_one_line(flags, message):
    with pytest.raises(ConfigError, match=message) as e:
        model_config_from_preset("small", vocab_size=40, **flags)
    assert "\n" not in str(e.value)


def test_a_checkpoint_written_before_time_reduction_reads_as_the_model_without_it():
    values = dataclasses.asdict(model_config_from_preset("small", vocab_size=40))
    for name in ADDED_OFF:
        del values[name]
    assert ModelConfig.from_dict(values) == model_config_from_preset("small", vocab_size=40)
    del values["cmvn"]  # a field of before format 2 is still refused
    with pytest.raises(ConfigError, match="has no cmvn"):
        ModelConfig.from_dict(values)


def test_self_conditioning_adds_the_ctc_posteriors_after_its_block_in_training_and_recognition():
    cfg = model_config_from_preset("small", vocab_size=40, self_condition_layer=3)
    torch.manual_seed(0)
    model = ASRModel(cfg).eval()
    assert model.encoder.ctc_condition.shape == (40, cfg.d_model)
    assert "encoder.ctc_condition" in ASRModel.VOCABULARY_TENSORS
    feats, lens = torch.randn(2, 401, 80), torch.tensor([401, 250])
    out, out_lens = model.encode(feats, lens)
    # without the conditioning's rows the encoder is the plain one with the same weights
    plain = ASRModel(model_config_from_preset("small", vocab_size=40)).eval()
    plain.load_state_dict(model.state_dict(), strict=False)
    assert not torch.allclose(out, plain.encode(feats, lens)[0])
    with torch.no_grad():
        model.encoder.ctc_condition.zero_()
    torch.testing.assert_close(model.encode(feats, lens)[0], plain.encode(feats, lens)[0])
    # the padding changes nothing: the shorter utterance alone gives its row
    torch.manual_seed(0)
    model = ASRModel(cfg).eval()
    out, _ = model.encode(feats, lens)
    alone, _ = model.encode(feats[1:, :250], lens[1:])
    torch.testing.assert_close(alone[0], out[1, :61], atol=1e-5, rtol=1e-5)
    # the tap is the block's states before the conditioning adds to them
    tap_states = []
    hook = model.encoder.blocks[2].register_forward_hook(lambda m, i, o: tap_states.append(o[0]))
    _, _, tapped = model.encoder.forward_tapped(model._normalized(feats, lens, None), lens,
                                                tap=3, head=model.ctc_head)
    hook.remove()
    assert torch.equal(tapped, tap_states[0])
    with pytest.raises(ValueError, match="needs the CTC head"):
        model.encoder(feats, lens)
    Objective(inter_ctc_weight=0.3, inter_ctc_layer=3, encoder_layers=6)(
        model.train(), feats, lens, torch.tensor([[5, 6, 7], [8, 9, -1]]),
        torch.tensor([3, 2])).loss.backward()
    assert model.encoder.ctc_condition.grad.abs().sum() > 0


@pytest.mark.parametrize("flags, message", [
    (dict(self_condition_layer=6), "want a block from 1 to 5"),
    (dict(self_condition_layer=2, causal_conv=True), "is for full-context models"),
    (dict(self_condition_layer=2, dynamic_chunk=True), "is for full-context models"),
    (dict(self_condition_layer=2, time_reduce_layer=3), "is for full-context models"),
])
def test_a_self_conditioning_the_encoder_cannot_run_is_one_line(flags, message):
    with pytest.raises(ConfigError, match=message) as e:
        model_config_from_preset("small", vocab_size=40, **flags)
    assert "\n" not in str(e.value)


def test_the_spec_augment_policy_sets_the_masks_and_its_ramp_widens_them():
    default = SpecAugment()  # the model's own: two of each, 27 bins, 40 frames at most 5%
    assert [m.mask_param for m in default.freq_masks] == [27, 27]
    assert [(m.mask_param, m.p) for m in default.time_masks] == [(40, 0.05), (40, 0.05)]
    policy = SpecAugment(freq_masks=1, freq_width=10, time_masks=3, time_width=20,
                         time_ratio=0.2)
    assert len(policy.freq_masks) == 1 and len(policy.time_masks) == 3
    feats = torch.randn(4, 300, 80) + 5  # no bin is 0 before masking
    torch.manual_seed(0)
    masked = policy(feats)
    zero_bins = (masked == 0).all(dim=1).sum(dim=1)  # frequency bins masked in every frame
    zero_frames = (masked == 0).all(dim=2).sum(dim=1)  # frames masked in every bin
    assert (zero_bins <= 10).all() and (zero_frames <= 3 * 20).all() and zero_frames.sum() > 0
    policy.set_scale(0.0)  # the ramp's start: no mask at all
    assert torch.equal(policy(feats), feats)
    policy.set_scale(0.5)
    assert [m.mask_param for m in policy.freq_masks] == [5]
    assert [m.mask_param for m in policy.time_masks] == [10, 10, 10]
    policy.set_scale(1.0)
    assert [m.mask_param for m in policy.time_masks] == [20, 20, 20]
    # the same draws as before the policy's flags existed (the default policy's masks)
    torch.manual_seed(3)
    a = default(feats)
    torch.manual_seed(3)
    x = feats.transpose(1, 2)
    for mask in [torchaudio.transforms.FrequencyMasking(27, iid_masks=True)] * 2 + [
            torchaudio.transforms.TimeMasking(40, iid_masks=True, p=0.05)] * 2:
        x = mask(x)
    assert torch.equal(a, x.transpose(1, 2))


def test_the_augmentation_curriculum_ramps_each_probability_over_its_epochs():
    ramped = Augmenter(AugmentConfig(noise_prob=0.6, vtlp_prob=0.3, augment_ramp_epochs=3))
    assert [round(ramped.ramped(0.6, e), 6) for e in range(5)] == [0.2, 0.4, 0.6, 0.6, 0.6]
    assert Augmenter(AugmentConfig(noise_prob=0.6)).ramped(0.6, 0) == 0.6
    assert "ramped up over 3 epochs" in ramped.describe()
    # the first epoch warps about a third as many utterances as the third
    warped = [sum(ramped.vtlp_alpha(e, i) is not None for i in range(600)) for e in (0, 2)]
    assert 0.2 < warped[0] / warped[1] < 0.5


def test_the_length_curriculum_takes_the_first_epochs_batches_shortest_first_and_resumes():
    durations = [1.0 + (7 * i % 23) / 4 for i in range(64)]
    inner = LengthGroupedBatchSampler(durations, 4, seed=3)
    sampler = LengthCurriculum(LengthGroupedBatchSampler(durations, 4, seed=3), durations, 2)
    for epoch in range(3):
        inner.set_epoch(epoch)
        sampler.set_epoch(epoch)
        plain, batches = inner.epoch_batches(), list(sampler)
        longest = [max(durations[i] for i in b) for b in batches]
        if epoch < 2:  # the same batches, shortest first
            assert sorted(map(sorted, batches)) == sorted(map(sorted, plain))
            assert longest == sorted(longest) and batches != plain
        else:
            assert batches == plain
        sampler.set_epoch(epoch, start=5)  # a resume after 5 batches goes on with the 6th
        assert list(sampler) == batches[5:] and len(sampler) == len(batches) - 5
    # off, it is not there; on, it sits under the preflight's worst batches
    assert isinstance(train_sampler(durations, 4, 0, 3, 10), LengthGroupedBatchSampler)
    wrapped = train_sampler(durations, 4, 0, 3, 10, preflight=2, curriculum_epochs=1)
    assert isinstance(wrapped.inner, LengthCurriculum)


def _train_rows(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"]


def _learns_and_resumes_exactly(tiny_corpus, whole, split, levers):
    """The 30 steps trained into ``whole`` lowered the loss by a fifth; trained into ``split`` as
    12 steps, then resumed to 30, they give the same losses."""
    rows = _train_rows(whole)
    first, last = rows[:5], rows[-5:]
    assert sum(r["loss"] for r in last) < 0.8 * sum(r["loss"] for r in first)
    assert cli.main(tiny_args(tiny_corpus, split, *levers, "--max_steps", "12")) == 0
    assert cli.main(tiny_args(tiny_corpus, split, *levers, "--max_steps", "30", "--resume",
                              "latest")) == 0
    resumed = _train_rows(split)
    assert [r["step"] for r in resumed] == [r["step"] for r in rows] == list(range(1, 31))
    for a, b in zip(resumed, rows, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (a, b)


@pytest.mark.slow
def test_intermediate_ctc_and_a_ramped_augmentation_on_kaldi_fbank_learn_and_resume_exactly(
    tiny_corpus, tmp_path, caplog
):
    """The levers on together, on the CPU recipe's Kaldi filterbanks (intermediate CTC, the
    augmentation ramp, the length curriculum, ScaledAdam with the Eden schedule, time reduction,
    the CTC weight and label smoothing ramped): the loss falls over 30 steps, and a run stopped at
    step 12 (mid-ramp, mid-curriculum) and resumed gives the unbroken run's losses."""
    levers = ["--inter_ctc_weight", "0.3", "--noise_prob", "0.5", "--vtlp_prob", "0.5",
              "--augment_ramp_epochs", "3", "--max_batch_frames", "2400",
              "--frontend", "kaldi_fbank", "--length_curriculum_epochs", "2",
              "--optimizer", "scaled_adam", "--lr", "0.03",
              "--lr_schedule", "eden", "--eden_steps", "20", "--eden_epochs", "1",
              "--time_reduce_layer", "1", "--time_recover_layer", "2",
              "--ctc_weight_from", "0.9", "--label_smoothing_from", "0", "--loss_ramp_steps", "20"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    with caplog.at_level(logging.INFO, logger="konkanivani"):
        assert cli.main(tiny_args(tiny_corpus, whole, *levers, "--max_steps", "30")) == 0
    assert "their probabilities ramped up over 3 epochs" in caplog.text
    assert "the first 2 epoch(s) take their batches shortest first" in caplog.text
    assert "Eden decay over 20 steps and 1 epochs" in caplog.text
    assert "optimizer: ScaledAdam (no weight decay)" in caplog.text
    assert ("loss ramps over the first 20 steps: CTC weight 0.9 -> 0.3, label smoothing 0 -> 0.1"
            in caplog.text)
    assert _train_rows(whole)[-1]["epoch"] >= 2  # the ramp's epochs were crossed
    _learns_and_resumes_exactly(tiny_corpus, whole, split, levers)


@pytest.mark.slow
def test_self_conditioned_ctc_and_a_ramped_spec_augment_policy_learn_and_resume_exactly(
    tiny_corpus, tmp_path
):
    """Self-conditioned CTC on the intermediate CTC's block, with a SpecAugment policy of its own
    widened over 20 steps: the loss falls over 30 steps, a run stopped at step 12 (mid-ramp) and
    resumed gives the unbroken run's losses, and the checkpoint holds the conditioning's table."""
    levers = ["--inter_ctc_weight", "0.3", "--inter_ctc_layer", "1", "--self_condition_layer",
              "1", "--spec_freq_masks", "1", "--spec_freq_width", "15", "--spec_time_masks", "3",
              "--spec_time_width", "20", "--spec_time_ratio", "0.1",
              "--spec_augment_ramp_steps", "20", "--max_batch_frames", "2400"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert cli.main(tiny_args(tiny_corpus, whole, *levers, "--max_steps", "30")) == 0
    _learns_and_resumes_exactly(tiny_corpus, whole, split, levers)
    saved = torch.load(whole / "latest.pt", map_location="cpu", weights_only=False)
    cfg = ModelConfig.from_dict(saved["model_config"])
    assert cfg.self_condition_layer == 1
    model = ASRModel(cfg)
    model.load_state_dict(saved["model"])  # the conditioning's rows are in the checkpoint
    assert model.encoder.ctc_condition.abs().sum() > 0


def test_self_conditioning_without_an_intermediate_ctc_on_its_block_is_named(tiny_corpus, tmp_path,
                                                                             caplog):
    with caplog.at_level(logging.WARNING, logger="konkanivani"):
        assert cli.main(tiny_args(tiny_corpus, tmp_path / "run", "--self_condition_layer", "1",
                                  "--max_steps", "1")) == 0
    assert ("--self_condition_layer 1 adds the CTC posteriors of block 1, which no intermediate "
            "CTC trains (give --inter_ctc_weight and --inter_ctc_layer 1)") in caplog.text


def test_a_bad_intermediate_layer_is_one_line_and_exit_2(tiny_corpus, tmp_path, capsys):
    out = tmp_path / "run"
    code = cli.main(tiny_args(tiny_corpus, out, "--inter_ctc_weight", "0.3", "--inter_ctc_layer",
                              "9", "--max_steps", "1"))
    assert code == 2
    assert "--inter_ctc_layer 9: the encoder's blocks are 1 to 2" in capsys.readouterr().err


def test_a_length_curriculum_on_shards_is_one_line_and_exit_2(tiny_corpus, tmp_path, capsys):
    out = tmp_path / "run"
    code = cli.main(tiny_args(tiny_corpus, out, "--train_shards", str(tmp_path / "shards"),
                              "--length_curriculum_epochs", "1", "--max_steps", "1"))
    assert code == 2 and not out.exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("--length_curriculum_epochs orders the rows of --train_manifest; "
                            "shards are read as they were written, a stream a worker"), err


def test_the_levers_table_gives_each_variants_mean_seeds_and_speed(tmp_path):
    rows = [
        {"variant": "today", "seed": 1, "s_per_step": 0.5, "test_joint": 8.0, "test_greedy": 9.0},
        {"variant": "today", "seed": 2, "s_per_step": 0.5, "test_joint": 9.0, "test_greedy": 10.0},
        {"variant": "inter", "seed": 1, "s_per_step": 0.55, "test_joint": 6.0,
         "test_greedy": 7.0},
    ]
    text = recipe_levers.table(rows, ["test"], ["greedy", "joint"])
    lines = text.splitlines()
    assert lines[0] == ("| variant | seeds | s/step | speed vs first | test_joint CER % | "
                        "test_greedy CER % |")
    assert lines[2] == "| today | 1,2 | 0.500 | 1.00x | **8.50** (8.00 / 9.00) | **9.50** " \
                       "(9.00 / 10.00) |"
    assert lines[3].startswith("| inter | 1 | 0.550 | 1.10x | **6.00** (6.00) |")
    args = recipe_levers.parse_args(["--variant", "today=", "--variant",
                                     "inter=--inter_ctc_weight 0.3", "--budget_steps", "10",
                                     "--seeds", "1,2", "--out", str(tmp_path)])
    assert args.variants == [("today", []), ("inter", ["--inter_ctc_weight", "0.3"])]
    assert args.seed_list == [1, 2]
    with pytest.raises(SystemExit):
        recipe_levers.parse_args(["--variant", "x", "--budget_steps", "1", "--out", "o"])
