"""--ema_decay: the moving average itself, what checkpoints keep of it, and who reads it."""
import dataclasses
import json

import pytest
import torch
from tiny_args import tiny_args
from torch.utils.data import DataLoader

from konkanivani.checkpoint import (
    InferenceModel,
    TrainState,
    average_checkpoints,
    load_checkpoint,
)
from konkanivani.cli import train as cli
from konkanivani.config import ModelConfig, TrainConfig
from konkanivani.data.dataset import ASRDataset, collate, load_utterances
from konkanivani.data.tokenizer import Tokenizer
from konkanivani.decoding.recognizer import Recognizer
from konkanivani.model.asr import ASRModel
from konkanivani.training.ema import ema_state, load_ema_state, make_ema
from konkanivani.training.objective import Objective
from konkanivani.training.precision import resolve_precision
from konkanivani.training.step import validate


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)
        # as CMVN: a buffer training never changes
        self.register_buffer("stat", torch.full((2,), 4.0))


def test_the_average_is_its_closed_form_from_a_copy_of_the_first_step():
    """ema_1 = θ_1, then ema_t = d_t·ema_{t-1} + (1-d_t)·θ_t with d_t = min(D, t / (t + 9)); the
    buffers come along unchanged. D = 0.75 is reached at t = 27."""
    torch.manual_seed(0)
    model, decay = _Toy(), 0.75
    ema = make_ema(model, decay)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    expected = None
    for t in range(1, 31):
        for p in model.parameters():
            # a hand-set gradient: θ_t = θ_{t-1} - 0.5·(t mod 7)
            p.grad = torch.full_like(p, float(t % 7))
        optimizer.step()
        ema.update_parameters(model)
        theta = [p.detach().clone() for p in model.parameters()]
        d = min(decay, t / (t + 9))
        expected = (
            theta if expected is None else [d * e + (1 - d) * th for e, th in zip(expected, theta)]
        )
        for got, want in zip(ema.module.parameters(), expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(ema.module.stat, torch.full((2,), 4.0))
    assert not any(p.requires_grad for p in ema.parameters())

    weights, updates = ema_state(ema)  # a checkpoint's share: the model's own keys, and the count
    assert set(weights) == set(model.state_dict()) and updates == 30
    again = make_ema(model, decay)
    load_ema_state(again, weights, updates)
    model.linear.weight.data += 1.0
    ema.update_parameters(model)
    again.update_parameters(model)
    assert all(
        torch.equal(a, b)
        for a, b in zip(ema.module.state_dict().values(), again.module.state_dict().values())
    )


def test_decoding_reads_the_ema_weights_averaging_the_training_ones_and_old_files_load(tmp_path):
    raw, averaged = {"w": torch.zeros(2)}, {"w": torch.ones(2)}
    parts = {"model_config": {}, "tokenizer": b"sp", "model": raw}
    with_ema = InferenceModel.of({**parts, "ema_model": averaged})
    assert with_ema.weights is averaged and with_ema.ema
    without = InferenceModel.of({**parts, "ema_model": {}})  # a run without EMA
    assert without.weights is raw and not without.ema
    assert InferenceModel.of(parts).weights is raw  # written before EMA existed

    state = TrainState(
        model_config={},
        train_config={},
        tokenizer=b"sp",
        model=raw,
        optimizer={"state": {}},
        ema_model=averaged,
        ema_updates=3,
    )
    files = [state.save(tmp_path / f"s{i}.pt") for i in range(2)]
    # the training weights, as before
    assert torch.equal(average_checkpoints(files)["model"]["w"], raw["w"])
    assert "ema_model" not in average_checkpoints(files)

    older = {k: v for k, v in load_checkpoint(files[0]).items() if not k.startswith("ema_")}
    loaded = TrainState.from_checkpoint(older, "older.pt")
    assert loaded.ema_model == {} and loaded.ema_updates == 0


@pytest.fixture(scope="module")
def ema_runs(tiny_corpus, tmp_path_factory):
    """Six steps with --ema_decay 0.9 unbroken, and stopped at 3 then resumed to 6."""
    whole, split = (
        tmp_path_factory.mktemp("ema_whole") / "run",
        tmp_path_factory.mktemp("ema_split") / "run",
    )
    flags = ("--ema_decay", "0.9", "--no_tensorboard")
    assert cli.main(tiny_args(tiny_corpus, whole, "--max_steps", "6", *flags)) == 0
    assert cli.main(tiny_args(tiny_corpus, split, "--max_steps", "3", *flags)) == 0
    assert (
        cli.main(tiny_args(tiny_corpus, split, "--max_steps", "6", "--resume", "latest", *flags))
        == 0
    )
    return whole, split


def test_a_resumed_run_keeps_the_same_average(ema_runs):
    whole, split = ema_runs
    a, b = load_checkpoint(whole / "latest.pt"), load_checkpoint(split / "latest.pt")
    assert a["ema_updates"] == b["ema_updates"] == 6  # one per update, none skipped here
    assert set(a["ema_model"]) == set(a["model"])
    for name, tensor in a["ema_model"].items():
        torch.testing.assert_close(b["ema_model"][name], tensor, rtol=1e-4, atol=1e-5)
    # not the raw weights
    assert any(not torch.equal(a["ema_model"][n], a["model"][n]) for n in a["model"])


def test_validation_and_decoding_use_the_ema_weights(ema_runs, tiny_corpus):
    whole, _ = ema_runs
    ckpt = load_checkpoint(whole / "latest.pt")
    row = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()][-1]
    assert row["kind"] == "valid" and row["step"] == 6 and row["ema_decay"] == 0.9

    tokenizer, cfg = Tokenizer(ckpt["tokenizer"]), ModelConfig.from_dict(ckpt["model_config"])
    utts, _ = load_utterances(tiny_corpus / "valid.jsonl", tokenizer)
    loader = DataLoader(ASRDataset(utts), batch_size=4, collate_fn=collate)
    objective = Objective.from_config(TrainConfig(**ckpt["train_config"]), cfg.encoder_layers)

    def valid_loss(weights):
        model = ASRModel(cfg)
        model.load_state_dict(weights)
        cpu = torch.device("cpu")
        return validate(model, loader, tokenizer, utts, cpu, resolve_precision(cpu, False, ""),
                        objective=objective, step=row["step"])["loss"]

    assert valid_loss(ckpt["ema_model"]) == pytest.approx(row["loss"], rel=1e-4)
    assert valid_loss(ckpt["model"]) != pytest.approx(row["loss"], rel=1e-3)

    recognizer = Recognizer.from_checkpoint(whole / "latest.pt")
    for name, tensor in recognizer.model.state_dict().items():
        assert torch.equal(tensor, ckpt["ema_model"][name])
    assert dataclasses.asdict(recognizer.model.cfg) == dataclasses.asdict(cfg)
