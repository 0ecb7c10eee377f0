"""A run's directory is never lost: re-runs, two runs at once, a broken latest.pt."""
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from konkanivani.checkpoint import (CheckpointError, hold_run_directory, load_checkpoint, load_resume_checkpoint,
                                    point_to, save_checkpoint, step_checkpoint_name)

from konkanivani.cli import train as cli  # noqa: E402

from tiny_args import tiny_args  # noqa: E402


def _snapshot(directory):
    """Every file under ``directory`` with its size and modification time."""
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != ".lock"}


def _errors(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.fixture(scope="module")
def first_run(tiny_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("first") / "run"
    assert cli.main(tiny_args(tiny_corpus, out, "--max_steps", "4", "--save_every_steps", "2")) == 0
    return out


def test_a_fresh_run_into_a_used_directory_is_refused_and_changes_nothing(first_run, tiny_corpus, caplog):
    before = _snapshot(first_run)
    assert "step_0000004.pt" in before and "metrics.jsonl" in before
    with caplog.at_level(logging.INFO, logger="konkanivani"):
        assert cli.main(tiny_args(tiny_corpus, first_run, "--max_steps", "6")) == 2
    errors = _errors(caplog)
    assert len(errors) == 1 and len(errors[0].splitlines()) == 1, errors
    assert "already holds a run" in errors[0] and "--resume latest" in errors[0] and "--overwrite" in errors[0]
    assert _snapshot(first_run) == before  # nothing written, appended, pruned or deleted


def test_overwrite_moves_the_old_run_aside_and_deletes_nothing(first_run, tiny_corpus, tmp_path, caplog):
    out = tmp_path / "run"
    shutil.copytree(first_run, out)  # a copy of the first run (its tensorboard/ too), hard links kept apart
    before = _snapshot(out)
    with caplog.at_level(logging.INFO, logger="konkanivani"):
        assert cli.main(tiny_args(tiny_corpus, out, "--max_steps", "3", "--overwrite")) == 0
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert len(aside) == 1
    assert {k: v[0] for k, v in _snapshot(aside[0]).items()} == {k: v[0] for k, v in before.items()}
    assert f"the previous run in {out} was moved to {aside[0]}" in caplog.text
    assert load_checkpoint(out / "latest.pt")["step"] == 3
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3]  # the new run's rows alone
    assert not (out / "step_0000004.pt").exists()  # the old run's files are only in the folder aside


def test_a_second_run_in_the_same_directory_is_refused_while_the_first_holds_it(tiny_corpus, tmp_path, caplog):
    out = tmp_path / "busy"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys
            from konkanivani.checkpoint import hold_run_directory
            with hold_run_directory({str(out)!r}):
                print("held", flush=True)
                sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with caplog.at_level(logging.INFO, logger="konkanivani"):
            assert cli.main(tiny_args(tiny_corpus, out, "--max_steps", "2")) == 2
        errors = _errors(caplog)
        assert len(errors) == 1 and "in use by another training run" in errors[0]
        assert f"pid {holder.pid}," in errors[0]
        assert sorted(p.name for p in out.iterdir()) == [".lock"]  # no log, tokenizer or checkpoint of its own
        holder.kill()  # kill -9: the kernel releases the lock with the process
        holder.wait()
        with hold_run_directory(out):
            pass
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_is_released_on_every_exit_of_a_run(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    corpus_missing = tmp_path / "nothing"
    corpus_missing.mkdir()
    assert cli.main(tiny_args(corpus_missing, out)) == 2  # an error inside the run
    probe = [sys.executable, "-c", f"from konkanivani.checkpoint import hold_run_directory as h\nwith h({str(out)!r}): "
             "print('free')"]
    assert subprocess.run(probe, capture_output=True, text=True, check=True).stdout.strip() == "free"


def _state(step):
    return {"step": step, "model": {"w": torch.full((2,), float(step))}}


def test_resume_latest_falls_back_to_the_newest_readable_checkpoint(tmp_path, caplog):
    for step in (2, 4):
        save_checkpoint(_state(step), tmp_path / step_checkpoint_name(step))
    point_to(tmp_path / "step_0000004.pt", tmp_path / "latest.pt")
    # A sync tool replaced latest.pt by a truncated copy: the step file is still whole.
    data = (tmp_path / "latest.pt").read_bytes()
    (tmp_path / "cut").write_bytes(data[: len(data) // 3])
    os.replace(tmp_path / "cut", tmp_path / "latest.pt")
    with caplog.at_level(logging.WARNING, logger="konkanivani"):
        state, path = load_resume_checkpoint("latest", tmp_path)
    assert state["step"] == 4 and path.name == "step_0000004.pt"
    assert "latest.pt" in caplog.text and "truncated" in caplog.text and "resuming from" in caplog.text

    # Truncated in place, the hard-linked step file is broken too: the one before it is used.
    with open(tmp_path / "step_0000004.pt", "r+b") as f:
        f.truncate(100)
    point_to(tmp_path / "step_0000004.pt", tmp_path / "latest.pt")
    state, path = load_resume_checkpoint("latest", tmp_path)
    assert state["step"] == 2 and path.name == "step_0000002.pt"

    # A path given outright is never swapped for another file; nothing readable is an error.
    with pytest.raises(CheckpointError, match="truncated"):
        load_resume_checkpoint(str(tmp_path / "step_0000004.pt"), tmp_path)
    (tmp_path / "step_0000002.pt").write_bytes(b"junk")
    with pytest.raises(CheckpointError, match="no readable checkpoint"):
        load_resume_checkpoint("latest", tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_resume_checkpoint("latest", tmp_path / "empty")


def test_cli_resumes_from_the_step_file_when_latest_is_broken(first_run, tiny_corpus, tmp_path, caplog):
    out = tmp_path / "run"
    shutil.copytree(first_run, out)  # copies: latest.pt is no longer a link to step 4
    (out / "latest.pt").write_bytes((out / "latest.pt").read_bytes()[:1000])
    with caplog.at_level(logging.INFO, logger="konkanivani"):
        assert cli.main(tiny_args(tiny_corpus, out, "--max_steps", "6", "--resume", "latest")) == 0
    assert "resuming from" in caplog.text and "step_0000004.pt" in caplog.text
    assert "at step 4" in caplog.text
    assert load_checkpoint(out / "latest.pt")["step"] == 6


def test_sigkill_of_a_training_run_frees_its_directory(tiny_corpus, tmp_path):
    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "fault_run.py"), "kill9_at_step", "2", "--",
                             *tiny_args(tiny_corpus, out, "--max_steps", "10")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    assert proc.wait(timeout=300) == -signal.SIGKILL
    with hold_run_directory(out):  # nobody holds it any more
        pass
