"""Train the tiny preset for real on synthesized Konkani speech, stop, resume, compare."""
import json
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_args import tiny_args  # noqa: E402

from konkanivani.checkpoint import load_checkpoint  # noqa: E402
from konkanivani.cli import train as cli  # noqa: E402
from konkanivani.training.optim import lr_factor  # noqa: E402


def _train_rows(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"], [r for r in rows if r["kind"] == "valid"]


@pytest.fixture(scope="module")
def runs(tiny_corpus, tmp_path_factory):
    """One uninterrupted run of 36 steps, and one stopped at step 20 and resumed to 36; both
    validate every 7 steps as well as at epoch ends."""
    whole, split = (
        tmp_path_factory.mktemp("whole") / "run",
        tmp_path_factory.mktemp("split") / "run",
    )
    assert (
        cli.main(tiny_args(tiny_corpus, whole, "--max_steps", "36", "--validate_every_steps", "7"))
        == 0
    )
    assert cli.main(tiny_args(tiny_corpus, split, "--max_steps", "20", "--save_every_steps", "10",
                              "--validate_every_steps", "7")) == 0
    return whole, split


def _epoch_ends(train_rows):
    return {a["step"] for a, b in zip(train_rows, train_rows[1:]) if b["epoch"] > a["epoch"]}


def test_tiny_model_learns(runs):
    whole, _ = runs
    train_rows, valid_rows = _train_rows(whole)
    losses = [r["loss"] for r in train_rows]
    assert [r["step"] for r in train_rows] == list(range(1, 37))
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses
    assert valid_rows[-1]["loss"] < valid_rows[0]["loss"]
    ckpt = load_checkpoint(whole / "latest.pt")
    assert ckpt["step"] == 36
    assert (whole / "best.pt").is_file() and (whole / "tokenizer.model").is_file()


def test_validation_every_n_steps_at_epoch_ends_and_at_max_steps(runs):
    whole, split = runs
    train_rows, valid_rows = _train_rows(whole)
    ends = _epoch_ends(train_rows)
    assert len(ends) >= 3
    # Every 7 steps, at each epoch's end (once, where both fall together), and at --max_steps.
    assert [r["step"] for r in valid_rows] == sorted(ends | {7, 14, 21, 28, 35, 36})
    steps_epochs = {r["step"]: r["epoch"] for r in train_rows}
    assert all(r["epoch"] == steps_epochs[r["step"]] for r in valid_rows)
    best = min(valid_rows, key=lambda r: (r["wer"], r["cer"], r["step"]))
    best_ckpt = load_checkpoint(whole / "best.pt")
    assert best_ckpt["valid_step"] == best["step"] and best_ckpt["valid_metrics"][
        "cer"
    ] == pytest.approx(best["cer"])
    # The run stopped by --max_steps at step 20 scored itself there too.
    assert 20 in [r["step"] for r in _train_rows(split)[1]]


def test_stop_and_resume_continue_the_same_run(runs, tiny_corpus, caplog):
    whole, split = runs
    stopped = load_checkpoint(split / "latest.pt")
    assert stopped["step"] == 20
    assert stopped["batches_done"] > 0  # stopped inside an epoch
    # the step checkpoints and latest.pt are whole files that can rebuild the run
    assert sorted(p.name for p in split.glob("step_*.pt"))[-1] == "step_0000020.pt"

    # A run that died after its last save left rows for steps that will be trained again.
    with open(split / "metrics.jsonl", "a") as f:
        f.write(
            json.dumps({"kind": "train", "step": 21, "epoch": 3, "loss": 1.0, "lr": 1.0}) + "\n"
        )
    # A different batch size would change which batches remain in the epoch: the saved one is kept.
    with caplog.at_level(logging.INFO, logger="konkanivani"):
        assert (
            cli.main(
                tiny_args(
                    tiny_corpus,
                    split,
                    "--max_steps",
                    "36",
                    "--resume",
                    "latest",
                    "--batch_size",
                    "8",
                )
            )
            == 0
        )
    assert "resumed from latest at step 20" in caplog.text
    assert "--batch_size 4 as in the checkpoint" in caplog.text

    resumed_rows, _ = _train_rows(split)
    whole_rows, _ = _train_rows(whole)
    assert [r["step"] for r in resumed_rows] == list(range(1, 37))
    first_after = resumed_rows[20]
    assert first_after["step"] == 21
    assert first_after["lr"] == pytest.approx(2e-3 * lr_factor(20, warmup_steps=8))
    for a, b in zip(resumed_rows, whole_rows, strict=True):
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-9)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (a, b)
    final_a, final_b = load_checkpoint(split / "latest.pt"), load_checkpoint(whole / "latest.pt")
    assert final_a["step"] == final_b["step"] == 36
    for name, tensor in final_b["model"].items():
        torch.testing.assert_close(final_a["model"][name], tensor, rtol=1e-4, atol=1e-5)


def _fault_run(fault, n, argv):
    """The CLI in a subprocess, with a real signal at a known point (tests/fault_run.py)."""
    return subprocess.run(
        [sys.executable, str(Path(__file__).parent / "fault_run.py"), fault, str(n), "--", *argv],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_sigterm_with_two_workers_saves_and_the_resumed_run_matches(runs, tiny_corpus, tmp_path):
    """SIGTERM (preemption, Colab disconnect) mid-epoch, --num_workers 2 on both sides of the
    break."""
    whole, _ = runs
    out = tmp_path / "term"
    args = tiny_args(tiny_corpus, out, "--max_steps", "20", "--num_workers", "2")
    result = _fault_run("sigterm_at_step", 10, args)
    assert result.returncode == 128 + signal.SIGTERM, result.stderr[-3000:]
    assert "SIGTERM received: finishing the current step" in result.stderr
    assert "stopped by SIGTERM at step 10" in result.stdout and result.stdout.rstrip().endswith(
        "--resume latest"
    )
    stopped = load_checkpoint(out / "latest.pt")
    assert stopped["step"] == 10 and stopped["batches_done"] > 0  # inside an epoch

    assert cli.main(args + ["--resume", "latest"]) == 0
    # Stopped inside an epoch, the run in this process has ended its workers: left alive, they
    # ignore the SIGTERM that ends daemon processes at exit, and the suite's exit waited for ever.
    assert multiprocessing.active_children() == []
    rows, whole_rows = _train_rows(out)[0], _train_rows(whole)[0][:20]
    assert [r["step"] for r in rows] == list(range(1, 21))
    for a, b in zip(rows, whole_rows, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (a, b)


def test_kill9_between_saves_leaves_the_last_save_and_the_same_seed_gives_the_same_losses(
    runs, tiny_corpus, tmp_path
):
    whole, _ = runs
    out = tmp_path / "killed"
    result = _fault_run(
        "kill9_at_step",
        5,
        tiny_args(tiny_corpus, out, "--save_every_steps", "2", "--max_steps", "36"),
    )
    assert result.returncode == -signal.SIGKILL
    assert sorted(p.name for p in out.glob("*.pt")) == [
        "latest.pt",
        "step_0000002.pt",
        "step_0000004.pt",
    ]
    assert not list(out.glob(".*.tmp*"))
    assert load_checkpoint(out / "latest.pt")["step"] == 4
    # Another process, same flags and --seed: the same losses, bit for bit.
    assert [r["loss"] for r in _train_rows(out)[0]] == [
        r["loss"] for r in _train_rows(whole)[0][:4]
    ]


def test_missing_manifest_is_a_clear_error_before_training(tmp_path, caplog):
    corpus = tmp_path / "nothing"
    corpus.mkdir()
    with caplog.at_level(logging.ERROR, logger="konkanivani"):
        assert cli.main(tiny_args(corpus, tmp_path / "out")) == 2
    assert "train.jsonl: file not found" in caplog.text
    assert not list((tmp_path / "out").glob("*.pt"))


def test_summary_lines_reach_a_redirected_console_and_train_log_without_a_bar(
    tiny_corpus, tmp_path
):
    """Output redirected to a file (not a terminal): no progress bar, the --log_every lines
    instead."""
    out = tmp_path / "quiet"
    argv = [
        a
        for a in tiny_args(tiny_corpus, out, "--max_steps", "4", "--log_every", "2")
        if a != "--no_progress"
    ]
    with open(tmp_path / "console.txt", "w") as console:
        result = subprocess.run(
            [sys.executable, "-m", "konkanivani.cli.train", *argv],
            stdout=console,
            stderr=subprocess.STDOUT,
            timeout=300,
        )
    assert result.returncode == 0
    text = (tmp_path / "console.txt").read_text()
    assert "\r" not in text and "it/s" not in text and "|" not in text  # no bar drawn into the file
    for logged in (text, (out / "train.log").read_text()):
        lines = [line for line in logged.splitlines() if " INFO step " in line and "loss" in line]
        assert [
            line.split(" INFO step ")[1].split()[0] for line in lines if "valid" not in line
        ] == ["2", "4"]
        assert all(
            key in lines[0]
            for key in (
                "(epoch 1, ",
                "loss ",
                "(ctc ",
                "attention ",
                " utt (",
                " s of audio) an update",
                "lr ",
                "grad norm ",
                "utt/s",
                "(data wait ",
                "memory ",
                "GiB",
            )
        ), lines[0]
    assert any("% of the time waiting for data" in line for line in text.splitlines())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= r["data_wait"] <= 1 for r in rows if r.get("kind") == "train")
    saved = [line for line in text.splitlines() if "saved " in line]
    assert len(saved) == len({line.split("saved ")[1] for line in saved})  # each save logged once


def test_progress_bar_fits_80_columns_and_log_lines_start_their_own_line(tiny_corpus, tmp_path):
    """On a terminal (a pseudo-terminal here), 200 columns wide: the bar stays within 80 columns and
    every log line written while it is shown starts at the beginning of a line."""
    import fcntl
    import pty
    import struct
    import termios

    out = tmp_path / "tty"
    argv = [
        a
        for a in tiny_args(tiny_corpus, out, "--max_steps", "6", "--log_every", "1")
        if a != "--no_progress"
    ]
    master, slave = pty.openpty()
    # 30 rows, 200 columns
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 200, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "konkanivani.cli.train", *argv],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the terminal closed with the process
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=300) == 0
    os.close(master)
    screen = b"".join(chunks).decode("utf-8", "replace")
    bars = [
        part
        for line in screen.split("\n")
        for part in line.split("\r")
        if "epoch 1/100" in part and "%|" in part
    ]
    assert bars, screen[-2000:]
    assert max(len(b.rstrip()) for b in bars) <= 80, max(bars, key=len)
    log_lines = [
        part for line in screen.split("\n") for part in line.split("\r") if " INFO " in part
    ]
    assert sum(" INFO step " in part for part in log_lines) >= 6
    assert all(part.lstrip()[:2].isdigit() for part in log_lines), [
        p for p in log_lines if not p[:2].isdigit()
    ]
