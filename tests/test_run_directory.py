"""A run's directory is never lost: re-runs, two runs at once, a broken latest.pt."""
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from tiny_args import tiny_args  # noqa: E402

from konkanivani.checkpoint import (
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
    step_checkpoint_name,
)
from konkanivani.cli import train as cli  # noqa: E402
from konkanivani.training.run_files import (
    check_output_dir,
    hold_run_directory,
    load_resume_checkpoint,
    move_run_aside,
    point_to,
)


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


def test_a_fresh_run_into_a_used_directory_is_refused_and_changes_nothing(
    first_run, tiny_corpus, caplog
):
    before = _snapshot(first_run)
    assert "step_0000004.pt" in before and "metrics.jsonl" in before
    with caplog.at_level(logging.INFO, logger="konkanivani"):
        assert cli.main(tiny_args(tiny_corpus, first_run, "--max_steps", "6")) == 2
    errors = _errors(caplog)
    assert len(errors) == 1 and len(errors[0].splitlines()) == 1, errors
    assert (
        "already holds a run" in errors[0]
        and "--resume latest" in errors[0]
        and "--overwrite" in errors[0]
    )
    assert _snapshot(first_run) == before  # nothing written, appended, pruned or deleted


def test_overwrite_moves_the_old_run_aside_and_deletes_nothing(
    first_run, tiny_corpus, tmp_path, caplog
):
    out = tmp_path / "run"
    # a copy of the first run (its tensorboard/ too), hard links kept apart
    shutil.copytree(first_run, out)
    before = _snapshot(out)
    with caplog.at_level(logging.INFO, logger="konkanivani"):
        assert cli.main(tiny_args(tiny_corpus, out, "--max_steps", "3", "--overwrite")) == 0
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert len(aside) == 1
    assert {k: v[0] for k, v in _snapshot(aside[0]).items()} == {k: v[0] for k, v in before.items()}
    assert f"the previous run in {out} was moved to {aside[0]}" in caplog.text
    assert load_checkpoint(out / "latest.pt")["step"] == 3
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # the new run's rows alone
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3]
    # the old run's files are only in the folder aside
    assert not (out / "step_0000004.pt").exists()


def test_a_second_run_in_the_same_directory_is_refused_while_the_first_holds_it(
    tiny_corpus, tmp_path, caplog
):
    out = tmp_path / "busy"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys
            from konkanivani.training.run_files import hold_run_directory
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
        # no log, tokenizer or checkpoint of its own
        assert sorted(p.name for p in out.iterdir()) == [".lock"]
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
    probe = [
        sys.executable,
        "-c",
        (
            "from konkanivani.training.run_files import hold_run_directory as h\nwith"
            f" h({str(out)!r}): print('free')"
        ),
    ]
    assert (
        subprocess.run(probe, capture_output=True, text=True, check=True).stdout.strip() == "free"
    )


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
    assert (
        "latest.pt" in caplog.text and "truncated" in caplog.text and "resuming from" in caplog.text
    )

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


def test_cli_resumes_from_the_step_file_when_latest_is_broken(
    first_run, tiny_corpus, tmp_path, caplog
):
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
    proc = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).parent / "fault_run.py"),
            "kill9_at_step",
            "2",
            "--",
            *tiny_args(tiny_corpus, out, "--max_steps", "10"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    assert proc.wait(timeout=300) == -signal.SIGKILL
    with hold_run_directory(out):  # nobody holds it any more
        pass


# ---- nothing lost, nothing left behind (fast: no training) -------------------------------------

TEXTS = ["हांव घरा वता", "तूं कितें करता"]


def _manifests(tmp_path, usable=()):
    """train.jsonl and valid.jsonl in ``tmp_path/data``, ten rows each: text to train a tokenizer
    on, and audio only for the manifests named in ``usable`` (the others' audio files are missing).
    """
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    sf.write(data / "a.wav", np.random.default_rng(0).normal(0, 0.1, 16000), 16000)
    for name in ("train", "valid"):
        audio = "a.wav" if name in usable else "missing.wav"
        rows = [{"audio_filepath": audio, "duration": 1.0, "text": TEXTS[i % 2]} for i in range(10)]
        (data / f"{name}.jsonl").write_text(
            "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8"
        )
    return data


def _flags(data, out, *extra):
    return [
        "--train_manifest",
        str(data / "train.jsonl"),
        "--valid_manifest",
        str(data / "valid.jsonl"),
        "--output_dir",
        str(out),
        "--device",
        "cpu",
        "--preset",
        "tiny",
        "--tokenizer_type",
        "char",
        "--vocab_size",
        "30",
        "--num_workers",
        "0",
        "--no_progress",
        *extra,
    ]


@pytest.mark.parametrize("name", ["best.pt", "model.pt"])
def test_a_folder_holding_only_a_checkpoint_is_a_run_to_protect(name, tmp_path, caplog):
    """A lone best.pt (or any checkpoint a user put there) is refused like a run, and the refusal
    leaves the folder as it was: no .lock of its own."""
    out = tmp_path / "run"
    save_checkpoint(_state(7), out / name)
    with caplog.at_level(logging.INFO, logger="konkanivani"):
        assert cli.main(_flags(_manifests(tmp_path), out)) == 2
    errors = _errors(caplog)
    assert len(errors) == 1 and len(errors[0].splitlines()) == 1, errors
    assert f"already holds a run ({name})" in errors[0]
    # latest would find no latest.pt nor step file there: the advice names the checkpoint itself
    assert f"--resume {out / name}," in errors[0] and "--resume latest" not in errors[0]
    assert "--overwrite" in errors[0]
    assert sorted(p.name for p in out.iterdir()) == [name]


def test_the_advice_for_a_folder_holding_only_best_pt_continues_the_run(tmp_path, caplog):
    """A real run's best.pt, all else gone: the refusal's --resume, followed, resumes from it."""
    data, out = _manifests(tmp_path, usable={"train", "valid"}), tmp_path / "run"
    assert cli.main(_flags(data, out, "--max_steps", "2")) == 0
    saved = load_checkpoint(out / "best.pt")["step"]
    for path in out.iterdir():
        if path.name != "best.pt":
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="konkanivani"):
        assert cli.main(_flags(data, out, "--max_steps", "4")) == 2
    [error] = _errors(caplog)
    advice = re.search(r"continue from its checkpoint with (--resume \S+),", error)
    assert advice is not None, error
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="konkanivani"):
        assert cli.main(_flags(data, out, "--max_steps", "4", *advice.group(1).split(" ", 1))) == 0
    assert f"at step {saved}" in caplog.text
    assert load_checkpoint(out / "latest.pt")["step"] == 4


def test_a_folder_holding_only_metrics_advises_no_resume(tmp_path, caplog):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 2.0}\n',
                                       encoding="utf-8")
    with caplog.at_level(logging.INFO, logger="konkanivani"):
        assert cli.main(_flags(_manifests(tmp_path), out)) == 2
    [error] = _errors(caplog)
    assert ("already holds a run (metrics.jsonl): no checkpoint to resume from; start a new one"
            in error)
    assert "--resume" not in error


def test_overwrite_moves_a_lone_checkpoint_aside(tmp_path):
    out = tmp_path / "run"
    save_checkpoint(_state(7), out / "best.pt")
    assert check_output_dir(out, "", overwrite=True)  # it must be moved aside first
    aside = move_run_aside(out)
    assert aside is not None and load_checkpoint(aside / "best.pt")["step"] == 7
    assert list(out.iterdir()) == []


def _hashes(root):
    """Every file under ``root`` (its .lock aside) with the SHA-256 of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".lock"}


@pytest.mark.parametrize("held", ["manifests", "audio", "init_from"])
def test_overwrite_never_moves_a_folder_holding_the_runs_own_inputs(held, tmp_path, caplog):
    """--overwrite moves everything in --output_dir aside: where that folder holds the manifests,
    only the audio they name, or the --init_from checkpoint (the old run's own best.pt), the run is
    refused in one line naming the input and the folder, exit 2, and nothing is moved or changed."""
    data = _manifests(tmp_path, usable={"train", "valid"})
    out, extra = data, ()  # the data folder, holding an earlier run's checkpoint too
    save_checkpoint(_state(7), data / "best.pt")
    if held == "audio":  # the manifests elsewhere, naming the audio in the run folder
        out = tmp_path / "run"
        out.mkdir()
        os.replace(data / "a.wav", out / "a.wav")
        os.replace(data / "best.pt", out / "best.pt")
        for name in ("train", "valid"):
            manifest = data / f"{name}.jsonl"
            manifest.write_text(manifest.read_text().replace('"a.wav"', json.dumps(
                str(out / "a.wav"))), encoding="utf-8")
    if held == "init_from":
        out = tmp_path / "run"
        save_checkpoint(_state(7), out / "best.pt")
        extra = ("--init_from", str(out / "best.pt"))
    read = {"manifests": data / "train.jsonl", "audio": out / "a.wav",
            "init_from": out / "best.pt"}[held]
    before = _hashes(tmp_path)
    with caplog.at_level(logging.INFO, logger="konkanivani"):
        assert cli.main(_flags(data, out, "--overwrite", *extra)) == 2
    [error] = _errors(caplog)
    assert len(error.splitlines()) == 1
    assert f"--overwrite would move {read}, which this run reads, out of --output_dir {out}" \
        in error
    assert "nothing was moved" in error
    assert _hashes(tmp_path) == before  # every byte where it was, nothing moved aside or added
    assert not list(tmp_path.glob("*.replaced-*"))


@pytest.mark.parametrize("unusable", ["train", "valid"])
def test_nothing_is_written_or_moved_before_the_data_is_known_usable(unusable, tmp_path, caplog):
    """A manifest with no usable row is one line and exit 2, and leaves the output folder as it
    was: no tokenizer.model, train.log or .lock, an earlier run not moved aside by --overwrite,
    a folder that did not exist not made."""
    data = _manifests(tmp_path, usable={"train", "valid"} - {unusable})
    manifest = data / f"{unusable}.jsonl"
    kept = tmp_path / "kept"
    save_checkpoint(_state(7), kept / "best.pt")
    for out, extra in ((tmp_path / "new" / "run", ()), (kept, ("--overwrite",))):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="konkanivani"):
            assert cli.main(_flags(data, out, *extra)) == 2
        errors = _errors(caplog)
        assert len(errors) == 1 and len(errors[0].splitlines()) == 1, errors
        name = "training" if unusable == "train" else "validation"
        assert f"no usable utterance in the {name} manifest {manifest}" in errors[0]
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in kept.iterdir()) == ["best.pt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "kept"]  # nothing moved aside


def test_an_output_dir_that_cannot_be_made_is_one_line_and_exit_2(tmp_path, caplog):
    """Under a regular file (so that it fails as root too), and a regular file itself."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    data = _manifests(tmp_path)
    for out in (blocker / "run", blocker):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="konkanivani"):
            assert cli.main(_flags(data, out)) == 2
        errors = _errors(caplog)
        assert len(errors) == 1 and len(errors[0].splitlines()) == 1, errors
        assert errors[0] == f"cannot use {out} as the output directory: {blocker} is a file"
    assert blocker.read_text() == "not a folder"


def test_a_read_only_output_dir_is_one_line_and_exit_2(tmp_path, caplog):
    """Folders of mode 555: one to make the output directory in, and the output directory itself.
    Root (with CAP_DAC_OVERRIDE) writes into them anyway: skipped then."""
    data = _manifests(tmp_path)
    parent, existing = tmp_path / "ro", tmp_path / "ro_run"
    parent.mkdir()
    existing.mkdir()
    parent.chmod(0o555)
    existing.chmod(0o555)
    try:
        try:
            (parent / "probe").touch()
        except PermissionError:
            pass
        else:
            pytest.skip("this process writes into read-only folders (root)")
        for out, message in (
            (
                parent / "run",
                f"cannot make the output directory {parent / 'run'}: Permission denied",
            ),
            (existing, f"cannot write to the output directory {existing}: permission denied"),
        ):
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="konkanivani"):
                assert cli.main(_flags(data, out)) == 2
            errors = _errors(caplog)
            assert len(errors) == 1 and message in errors[0], errors
    finally:
        parent.chmod(0o755)
        existing.chmod(0o755)
    assert list(parent.iterdir()) == [] and list(existing.iterdir()) == []


def test_a_lock_made_for_a_block_that_wrote_nothing_is_removed_and_a_kept_one_is_not(tmp_path):
    out = tmp_path / "a" / "b"
    with hold_run_directory(out):
        assert sorted(p.name for p in out.iterdir()) == [".lock"]
    assert not (tmp_path / "a").exists()  # the folders it made went with it
    with hold_run_directory(out):
        (out / "metrics.jsonl").write_text("")
    assert sorted(p.name for p in out.iterdir()) == [".lock", "metrics.jsonl"]
    with hold_run_directory(out):  # a lock found there stays
        pass
    assert (out / ".lock").exists()
