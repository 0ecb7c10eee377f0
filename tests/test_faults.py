"""Faults a long run meets, injected into real (tiny) training runs; each must leave a loadable
checkpoint and a clear message. kill -9 happens in a subprocess (tests/fault_run.py)."""
import errno
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from scipy.signal import resample_poly

from konkanivani.checkpoint import load_checkpoint
from konkanivani.training import loop as train_module
from konkanivani.training.metrics_log import MetricsLog
from konkanivani.training.signals import diverged_message
from konkanivani.training.step import optimizer_step

ROOT = Path(__file__).resolve().parents[1]
from tiny_args import tiny_args  # noqa: E402

from konkanivani.cli import train as cli  # noqa: E402
from konkanivani.cli import validate as validate_manifest  # noqa: E402


def _temporaries(out):
    return sorted(p.name for p in out.glob(".*.tmp*"))


def _on_call(monkeypatch, name, action):
    """Patch ``konkanivani.training.loop.<name>`` to run ``action(call number, result, *args)``
    after each call."""
    real, calls = getattr(train_module, name), [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        return action(calls[0], real(*args, **kwargs), *args)

    monkeypatch.setattr(train_module, name, wrapper)


def test_kill9_while_writing_a_checkpoint_keeps_the_previous_one(tiny_corpus, tmp_path, caplog):
    out = tmp_path / "run"
    # Saves come at steps 3 and 6; the second is killed with half its bytes written.
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "fault_run.py"),
            "kill9_in_save",
            "2",
            "--",
            *tiny_args(tiny_corpus, out, "--save_every_steps", "3", "--max_steps", "20"),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    assert not (out / "step_0000006.pt").exists()
    [partial] = _temporaries(out)
    assert partial.startswith(".step_0000006.pt.tmp")
    assert load_checkpoint(out / "latest.pt")["step"] == 3

    with caplog.at_level(logging.INFO, logger="konkanivani"):
        assert cli.main(tiny_args(tiny_corpus, out, "--save_every_steps", "3", "--max_steps", "8",
                              "--resume", "latest")) == 0
    assert (
        f"removed 1 unfinished checkpoint writes of a run killed while saving: {partial}"
        in caplog.text
    )
    assert "resumed from latest at step 3" in caplog.text
    assert _temporaries(out) == []
    assert load_checkpoint(out / "latest.pt")["step"] == 8


def test_full_disk_is_a_clear_error_and_the_previous_checkpoint_stays(
    tiny_corpus, tmp_path, monkeypatch, caplog
):
    out, real_save, saves = tmp_path / "run", torch.save, []

    def save_on_a_full_disk(obj, f, *args, **kwargs):
        saves.append(1)
        if len(saves) == 2:
            f.write(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_on_a_full_disk)
    with caplog.at_level(logging.ERROR, logger="konkanivani"):
        assert (
            cli.main(tiny_args(tiny_corpus, out, "--save_every_steps", "2", "--max_steps", "10"))
            == 2
        )
    assert (f"could not write checkpoint {out / 'step_0000004.pt'}: No space left on device; "
            "the previous checkpoints are untouched") in caplog.text
    assert sorted(p.name for p in out.glob("*.pt")) == ["latest.pt", "step_0000002.pt"]
    assert _temporaries(out) == []
    assert load_checkpoint(out / "latest.pt")["step"] == 2


@pytest.fixture
def interactive_sigint():
    """SIGINT as an interactive shell leaves it: Python's KeyboardInterrupt. A job started with
    ``cmd &`` from a script (no job control) inherits SIGINT ignored, and Python keeps it so."""
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, inherited)


def test_ctrl_c_saves_and_stops_and_a_second_one_interrupts_at_once(
    tiny_corpus, tmp_path, monkeypatch, caplog, capsys, interactive_sigint
):
    sigint_before = signal.getsignal(signal.SIGINT)
    sigterm_before = signal.getsignal(signal.SIGTERM)

    def ctrl_c(times):
        def action(n, grad_norm, *args):
            if n == 2:
                # raise_signal targets this (the main) thread and runs the Python handler before it
                # returns, so the two are handled one after the other.
                for _ in range(times):
                    signal.raise_signal(signal.SIGINT)
            return grad_norm
        return action

    _on_call(monkeypatch, "optimizer_step", ctrl_c(1))
    once = tmp_path / "once"
    with caplog.at_level(logging.INFO, logger="konkanivani"):
        assert cli.main(tiny_args(tiny_corpus, once, "--max_steps", "50")) == 130
    assert "SIGINT received: finishing the current step, then saving and stopping" in caplog.text
    assert load_checkpoint(once / "latest.pt")["step"] == 2
    printed = capsys.readouterr().out
    assert "stopped by SIGINT at step 2" in printed
    assert printed.rstrip().endswith(
        f"--output_dir {once} --preset tiny --vocab_size 48 --batch_size 4 "
        "--gradient_accumulation_steps 2 --lr 2e-3 --warmup_steps 8 --epochs 100 "
        "--log_every 1 --num_workers 0 --no_progress --seed 5 --max_steps 50 "
        "--resume latest"
    )
    assert (
        signal.getsignal(signal.SIGINT) is sigint_before
        and signal.getsignal(signal.SIGTERM) is sigterm_before
    )

    _on_call(monkeypatch, "optimizer_step", ctrl_c(2))
    twice = tmp_path / "twice"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="konkanivani"):
        assert (
            cli.main(tiny_args(tiny_corpus, twice, "--max_steps", "50", "--save_every_steps", "1"))
            == 130
        )
    assert "interrupted at once by a second Ctrl-C" in caplog.text
    assert load_checkpoint(twice / "latest.pt")["step"] == 1  # step 2 never finished
    assert (
        signal.getsignal(signal.SIGINT) is sigint_before
        and signal.getsignal(signal.SIGTERM) is sigterm_before
    )


def test_max_time_saves_and_stops_with_success(tiny_corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(tiny_args(tiny_corpus, out, "--max_time", "1e-9", "--max_steps", "50")) == 0
    assert load_checkpoint(out / "latest.pt")["step"] == 1
    assert "stopped by --max_time at step 1" in capsys.readouterr().out


def test_non_finite_updates_are_skipped_named_and_stop_the_run(
    tiny_corpus, tmp_path, monkeypatch, caplog
):
    """Step 2: NaN gradients; step 3: NaN loss; steps 5 on: both, until 3 in a row stop the run."""
    def poison(n, stats, model, *args):
        if n == 2 or n >= 5:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.fill_(math.nan)
        if n >= 3 and n != 4:
            stats = {**stats, "loss": math.nan}
        return stats

    _on_call(monkeypatch, "forward_backward", poison)
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="konkanivani"):
        assert (
            cli.main(
                tiny_args(
                    tiny_corpus,
                    out,
                    "--save_every_steps",
                    "1",
                    "--keep_checkpoints",
                    "10",
                    "--max_consecutive_skips",
                    "3",
                    "--max_steps",
                    "50",
                )
            )
            == 3
        )
    manifest = tiny_corpus / "train.jsonl"
    assert (
        f"step 2: non-finite gradients, update skipped (1 in a row, 1 in all); batch: {manifest}:"
        in caplog.text
    )
    assert "step 3: non-finite loss, update skipped (2 in a row, 2 in all)" in caplog.text
    assert ".wav)" in caplog.text  # the batch's audio files are named
    assert (
        "3 updates in a row were skipped for a non-finite loss or gradients (steps 5 to 7), so"
        f" training stopped. The weights are those of step 4, saved in {out / 'latest.pt'}"
        in caplog.text
    )
    weights = {s: load_checkpoint(out / f"step_{s:07d}.pt")["model"] for s in (1, 3, 4, 7)}
    assert load_checkpoint(out / "latest.pt")["step"] == 7

    def same(a, b):
        return all(torch.equal(weights[a][k], weights[b][k]) for k in weights[a])
    assert same(1, 3) and same(4, 7) and not same(3, 4)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] is None for r in rows if r["kind"] == "train"] == [
        False,
        False,
        True,
        False,
        True,
        True,
        True,
    ]


def test_fp16_overflow_is_skipped_and_lowers_the_scale_on_cpu():
    """The GradScaler path (fp16 on CUDA) runs on the CPU too: an overflow skips the update."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=True, init_scale=1024.0)

    def step(poisoned):
        loss = model(torch.ones(4, 3)).square().sum()
        scaler.scale(loss).backward()
        if poisoned:
            model.weight.grad[0, 0] = math.inf
        return optimizer_step(model, optimizer, scaler, grad_clip=5.0, loss=loss.item())

    before = model.weight.detach().clone()
    assert not math.isfinite(step(poisoned=True))
    assert torch.equal(model.weight, before) and scaler.get_scale() == 512.0
    assert math.isfinite(step(poisoned=False))
    assert not torch.equal(model.weight, before)
    assert "--precision bf16" in diverged_message(20, 40, Path("out"), fp16=True)


def test_metrics_line_cut_by_a_kill_is_dropped_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"kind": "train", "step": 1, "loss": 2.0}\n{"kind": "train", "step": 2, "loss": 1.5}\n'
        '{"kind": "train", "st'
    )
    MetricsLog(path).truncate(1)
    assert path.read_text() == '{"kind": "train", "step": 1, "loss": 2.0}\n'


@pytest.fixture
def bad_corpus(tiny_corpus, tmp_path):
    """The tiny corpus with five bad rows appended to train.jsonl, lines 52 to 56."""
    corpus = tmp_path / "corpus"
    shutil.copytree(tiny_corpus, corpus)
    wavs = corpus / "wavs"
    audio, sr = sf.read(wavs / "train_00000.wav")
    (wavs / "corrupt.wav").write_bytes(b"RIFF\x24\x00\x00\x00WAVEfmt garbage")
    good = (wavs / "train_00001.wav").read_bytes()
    (wavs / "truncated.wav").write_bytes(good[: len(good) // 3])
    sf.write(wavs / "empty.wav", np.zeros(0), sr)
    low = resample_poly(audio, 1, 2)
    sf.write(wavs / "stereo8k.wav", np.stack([low, low], axis=1), sr // 2)
    nan = audio.astype(np.float32)
    nan[100] = np.nan
    # a valid header: the NaN shows only when read
    sf.write(wavs / "nan.wav", nan, sr, subtype="FLOAT")
    rows = [
        json.loads(line)
        for line in (corpus / "train.jsonl").read_text(encoding="utf-8").splitlines()
    ]
    text, duration = rows[0]["text"], rows[0]["duration"]
    with open(corpus / "train.jsonl", "a", encoding="utf-8") as f:
        for name in ("corrupt", "truncated", "empty", "stereo8k", "nan"):
            d = rows[1]["duration"] if name == "truncated" else duration
            f.write(json.dumps({"audio_filepath": f"wavs/{name}.wav", "duration": d, "text": text},
                               ensure_ascii=False) + "\n")
    return corpus


def test_validate_manifest_names_every_bad_row_and_writes_a_clean_copy(
    bad_corpus, tmp_path, capsys, caplog
):
    manifest = bad_corpus / "train.jsonl"
    with open(manifest, "ab") as f:
        # Latin-1, not UTF-8
        f.write(b'{"audio_filepath": "wavs/train_00002.wav", "text": "caf\xe9"}\n')
    cleaned = tmp_path / "elsewhere" / "clean.jsonl"
    assert validate_manifest.main([str(manifest), "--output", str(cleaned)]) == 1
    printed = capsys.readouterr().out
    for line, reason in ((52, "audio unreadable"), (53, "duration mismatch"), (54, "audio empty"),
                         (56, "audio holds NaN or infinite samples")):
        assert f"ERROR {manifest}:{line}: {reason}" in printed
    assert f"ERROR {manifest}: 1 of 57 lines not JSON objects (line 57)" in printed
    assert (
        f"warning {manifest}:55: not 16 kHz" in printed
        and f"warning {manifest}:55: not mono" in printed
    )
    assert f"{manifest}: 57 rows, 52 good, 5 with errors, 2 warnings" in printed
    # paths rewritten for the new folder
    assert validate_manifest.main([str(cleaned), "--quiet"]) == 0
    assert f"{cleaned}: 52 rows, 52 good, 0 with errors, 2 warnings" in capsys.readouterr().out

    # Training stops on the non-UTF-8 line before it touches a checkpoint, naming the line.
    out = tmp_path / "run"
    with caplog.at_level(logging.ERROR, logger="konkanivani"):
        assert cli.main(tiny_args(bad_corpus, out)) == 2
    assert (
        f"{manifest}:57: not a JSON line" in caplog.text and "validate_manifest.py" in caplog.text
    )
    assert not list(out.glob("*.pt"))


def test_training_skips_bad_rows_and_counts_a_file_that_fails_mid_epoch(
    bad_corpus, tmp_path, caplog
):
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="konkanivani"):
        assert cli.main(tiny_args(bad_corpus, out, "--max_steps", "7")) == 0
    manifest = bad_corpus / "train.jsonl"
    assert (
        f"train manifest {manifest}: 53 utterances, 3 rows skipped (1 audio unreadable, 1 duration"
        " mismatch, 1 audio empty)"
        in caplog.text
    )
    assert (
        f"{manifest}: audio converted to 16 kHz mono when loaded (rows not 16 kHz: 1, not mono: 1)"
        in caplog.text
    )
    # nan.wav passes the header check at start; reading it mid-epoch fails, and the epoch goes on.
    assert (
        f"epoch 1: 1 audio files could not be read and were left out: {manifest}:56" in caplog.text
    )
    assert load_checkpoint(out / "latest.pt")["step"] == 7


def _checkpoint_writes(monkeypatch):
    """The names of the checkpoint files written from now on, in order, one entry a write."""
    from konkanivani import checkpoint

    real, written = checkpoint.save_checkpoint, []

    def counted(state, path):
        written.append(Path(path).name)
        return real(state, path)

    monkeypatch.setattr(checkpoint, "save_checkpoint", counted)
    return written


def test_each_step_is_written_once_with_its_validation(tiny_corpus, tmp_path, monkeypatch):
    """Saving every step, validating every second one and at each epoch's end, and stopping at
    --max_steps: the saves that fall on the same step are one write, the one with the metrics."""
    written = _checkpoint_writes(monkeypatch)
    out = tmp_path / "run"
    assert (
        cli.main(
            tiny_args(
                tiny_corpus,
                out,
                "--epochs",
                "2",
                "--save_every_steps",
                "1",
                "--validate_every_steps",
                "2",
                "--keep_checkpoints",
                "100",
            )
        )
        == 0
    )
    last = load_checkpoint(out / "latest.pt")["step"]
    assert written == [f"step_{s:07d}.pt" for s in range(1, last + 1)]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    validated = [r["step"] for r in rows if r["kind"] == "valid"]
    assert last in validated and len(validated) > last // 2  # every second step, and the epoch ends
    for step in validated:
        state = load_checkpoint(out / f"step_{step:07d}.pt")
        assert state["valid_step"] == step and state["valid_metrics"]

    written.clear()
    assert (
        cli.main(
            tiny_args(tiny_corpus, tmp_path / "stop", "--max_steps", "3", "--save_every_steps", "3")
        )
        == 0
    )
    assert written == ["step_0000003.pt"]
    assert load_checkpoint(tmp_path / "stop" / "latest.pt")["valid_step"] == 3


def test_a_validation_that_fails_at_an_epoch_end_still_keeps_the_epoch(
    tiny_corpus, tmp_path, monkeypatch, caplog
):
    def broken(*args, **kwargs):
        raise RuntimeError("injected validation failure")

    monkeypatch.setattr(train_module, "validate", broken)
    written = _checkpoint_writes(monkeypatch)
    out = tmp_path / "run"
    with (
        caplog.at_level(logging.INFO, logger="konkanivani"),
        pytest.raises(RuntimeError, match="injected"),
    ):
        cli.main(tiny_args(tiny_corpus, out))
    state = load_checkpoint(out / "latest.pt")
    assert state["epoch"] == 1 and state["batches_done"] == 0 and state["valid_step"] == -1
    assert written == [f"step_{state['step']:07d}.pt"]
    assert (
        f"validation at the end of epoch 1 failed; the epoch is saved in {out / written[0]}"
        in caplog.text
    )


# ---- a model too big for the machine (issue 51): refused before it is built -------------------

MEMORY_LIMIT = 8 * 2 ** 30  # address space of each run below: a regression fails, the machine stays


def _limited_run(argv: list[str], tool: str = "train") -> subprocess.CompletedProcess:
    """``konkanivani-<tool> argv`` in a process whose address space is capped (``RLIMIT_AS``)."""
    def limit() -> None:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))

    code = f"import sys; from konkanivani.cli.{tool} import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          timeout=600, preexec_fn=limit)


def _corpus_bytes(corpus: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(corpus.glob("*.jsonl"))}


@pytest.mark.slow
@pytest.mark.parametrize("flags, message", [
    (["--d_model", "100000", "--n_heads", "2"], "(--d_model 100000 --n_heads 2 "),
    (["--ffn_dim", "100000000"], "--ffn_dim 100000000 "),
    (["--frontend", "kaldi_fbank", "--n_mels", "100000"],
     "--n_mels 100000: the kaldi_fbank front-end's spectrum has 256 frequency bins"),
    (["--frontend", "kaldi_fbank", "--n_mels", "1000"], "--n_mels 1000: the kaldi_fbank"),
    (["--n_mels", "300"], "--n_mels 300: the log_mel front-end's spectrum has 201"),
    (["--max_memory_gb", "0.01"], "more than --max_memory_gb (0.0 GiB)"),
    # about 9 GiB by the estimate: within the machine's RAM, not within the limit of the process
    (["--ffn_dim", "400000"], "more than the RAM available to this process ("),
])
def test_a_model_that_cannot_fit_is_refused_in_one_line_before_the_folder(tiny_corpus, tmp_path,
                                                                        flags, message):
    before = _corpus_bytes(tiny_corpus)
    out = tmp_path / "run"
    result = _limited_run(tiny_args(tiny_corpus, out, "--max_steps", "2", *flags))
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(errors) == 1 and message in errors[0], errors
    assert "Traceback" not in result.stderr
    if "needs an estimated" in errors[0]:
        assert "parameters) needs an estimated" in errors[0] and "GiB" in errors[0]
    assert not out.exists()  # no folder claimed: no config.yaml, tokenizer or .lock
    assert _corpus_bytes(tiny_corpus) == before


@pytest.mark.slow
def test_mel_bins_some_of_which_hold_no_frequency_train_with_a_warning(tiny_corpus, tmp_path):
    result = _limited_run(tiny_args(tiny_corpus, tmp_path / "run", "--max_steps", "1",
                                    "--frontend", "kaldi_fbank", "--n_mels", "128"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert ("--n_mels 128: 1 of the kaldi_fbank front-end's 128 mel bins holds no frequency"
            in result.stderr and "124 is the most without any" in result.stderr)


@pytest.mark.slow
def test_init_from_with_model_flags_too_big_is_refused(tiny_corpus, tiny_run, tmp_path):
    out = tmp_path / "run"
    result = _limited_run(tiny_args(tiny_corpus, out, "--max_steps", "2", "--init_from",
                                    str(tiny_run / "best.pt"), "--ffn_dim", "100000000"))
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-2000:]
    assert "--ffn_dim 100000000 " in errors[0] and "needs an estimated" in errors[0]
    assert not out.exists()


@pytest.mark.slow
def test_a_sweep_trial_too_big_is_skipped_and_the_sweep_goes_on(tiny_corpus, tmp_path):
    out = tmp_path / "sweep"
    shared = tiny_args(tiny_corpus, "unused", "--max_steps", "2")
    i = shared.index("--output_dir")
    argv = ["--output_dir", str(out), "--grid", "ffn_dim=64,100000000", *shared[:i],
            *shared[i + 2:]]
    result = _limited_run(argv, tool="sweep")
    assert result.returncode == 0, result.stderr[-2000:]
    small = json.loads((out / "ffn_dim-64" / "trial.json").read_text())
    big = json.loads((out / "ffn_dim-100000000" / "trial.json").read_text())
    assert small["status"] == "done"
    assert big["status"] == "skipped" and "needs an estimated" in big["reason"], big
    assert not (out / "ffn_dim-100000000" / "config.yaml").exists()
