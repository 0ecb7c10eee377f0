"""benchmarks/step_breakdown.py (issue 55): the trainer and the model alone side by side on the same
batches, and the trainer's step by phase; the model alone's steps leave the trainer's run as it
would be without them."""
from __future__ import annotations

import json

import pytest
import torch
from benchmark_modules import load

from konkanivani.checkpoint import load_checkpoint
from konkanivani.cli import train as cli

breakdown = load("step_breakdown")


@pytest.mark.slow
def test_the_breakdown_rates_both_and_leaves_the_trainer_as_it_would_be(tiny_corpus, tmp_path):
    out = tmp_path / "breakdown"
    flags = ["--vocab_size", "48", "--batch_size", "4", "--num_workers", "0", "--no_progress",
             "--noise_prob", "0", "--ema_decay", "0.9"]
    assert breakdown.main(["--corpus", str(tiny_corpus), "--presets", "tiny", "--steps", "6",
                           "--warmup", "2", "--log_every", "2", "--out", str(out), *flags]) == 0
    row = json.loads((out / "breakdown.json").read_text())[0]
    assert row["steps"] == 3  # steps 3 to 5: the last ends the run without an on_step
    assert row["trainer_utt_per_s"] > 0 and row["model_utt_per_s"] > 0
    phases = row["phases_ms_per_step"]
    assert set(phases) == set(breakdown.PHASES) and min(phases.values()) >= 0
    assert phases["forward+backward"] > 0 and phases["ema"] > 0 and phases["data"] > 0
    # the timed phases are inside the step ("other" is what is left of it)
    assert sum(phases.values()) == pytest.approx(row["trainer_ms_per_step"], rel=1e-6)
    assert "| tiny | 3 |" in (out / "table.md").read_text()
    # the same run without the benchmark: the same weights, step for step
    plain = tmp_path / "plain"
    args = ["--train_manifest", str(tiny_corpus / "train.jsonl"), "--valid_manifest",
            str(tiny_corpus / "valid.jsonl"), "--output_dir", str(plain), "--config",
            str(breakdown.RECIPE), "--preset", "tiny", "--max_steps", "6",
            "--validate_every_steps", "0", "--save_every_steps", "0", "--log_every", "2",
            "--seed", "1234", *flags]
    assert cli.main(args) == 0
    ours, theirs = (load_checkpoint(d / "latest.pt") for d in (out / "run" / "tiny", plain))
    assert ours["step"] == theirs["step"] == 6
    assert all(torch.equal(ours["model"][k], theirs["model"][k]) for k in theirs["model"])
