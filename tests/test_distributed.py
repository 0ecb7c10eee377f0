"""Data parallelism with torchrun: 2 CPU processes (gloo) against 1, and SIGTERM to the launcher."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny_args import tiny_args

from konkanivani.checkpoint import load_checkpoint
from konkanivani.data.manifest import read_manifest
from konkanivani.data.tokenizer import train_tokenizer
from konkanivani.training.metrics_log import read_metrics

SCRIPT = Path(__file__).resolve().parents[1] / "training_scripts" / "train_konkanivani_asr.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # two processes on two cores


def _torchrun(args, **kwargs):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(SCRIPT),
            *args,
        ],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kwargs,
    )


def _rows(out, kind="train"):
    """Every row of ``kind`` in OUT/metrics.jsonl as written, not merged by step as
    ``read_metrics`` merges them: a step written twice (by both processes, or left by a resume that
    did not drop it) is seen here."""
    return [
        r
        for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        if r["kind"] == kind
    ]


@pytest.fixture(scope="module")
def tokenizer_path(tiny_corpus, tmp_path_factory):
    """One tokenizer for every run, so that runs differ only in how they are parallel."""
    path = tmp_path_factory.mktemp("tok") / "tok.model"
    texts = [row["text"] for _, row in read_manifest(tiny_corpus / "train.jsonl")]
    train_tokenizer(texts, 48).save(path)
    return path


def _args(tiny_corpus, out, tokenizer_path, *extra):
    args = tiny_args(tiny_corpus, out, "--tokenizer", str(tokenizer_path), "--no_preflight", *extra)
    i = args.index("--gradient_accumulation_steps")
    return args[:i] + args[i + 2:]  # each test says its own accumulation


EXACT = ("--dropout", "0", "--no_spec_augment", "--max_steps", "6", "--save_every_steps", "3",
         "--keep_checkpoints", "5")


def _one_process(tiny_corpus, out, tokenizer_path, *extra):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *_args(tiny_corpus, out, tokenizer_path, *extra)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


@pytest.fixture(scope="module")
def one_process(tiny_corpus, tokenizer_path, tmp_path_factory):
    """Batch 4 accumulated twice in one process. Dropout and SpecAugment, whose random draws differ
    between the processes of a data-parallel run, are off."""
    out = tmp_path_factory.mktemp("one") / "run"
    _one_process(tiny_corpus, out, tokenizer_path, "--gradient_accumulation_steps", "2", *EXACT)
    return out


def _assert_same_run(a_dir, b_dir, rtol, atol):
    a, b = load_checkpoint(a_dir / "latest.pt"), load_checkpoint(b_dir / "latest.pt")
    assert a["step"] == b["step"] == 6
    for name, tensor in b["model"].items():
        torch.testing.assert_close(a["model"][name], tensor, rtol=rtol, atol=atol)
    for ra, rb in zip(_rows(a_dir), _rows(b_dir), strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5), (ra, rb)


@pytest.mark.parametrize("strategy,atol", [("ddp", 1e-6), ("fsdp", 1e-4)])
def test_two_gloo_processes_end_with_the_parameters_of_one_process_with_the_same_batches(
        tiny_corpus, tokenizer_path, one_process, tmp_path, strategy, atol):
    """Batch 4 in each of 2 processes = batch 4 accumulated twice in one: the same utterances make
    each step (the shards interleave the same global batches)."""
    two = tmp_path / "two"
    proc = _torchrun(
        _args(
            tiny_corpus,
            two,
            tokenizer_path,
            "--gradient_accumulation_steps",
            "1",
            "--strategy",
            strategy,
            *EXACT,
        )
    )
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, output[-3000:]
    assert "8 utterances per update (batch 4 x 1 accumulation steps x 2 processes)" in output
    assert f"2 processes, {strategy}" in output
    assert output.count("done: step 6") == 1  # rank 0 reports, rank 1 is quiet
    # each process's random state is kept
    assert len(load_checkpoint(two / "latest.pt")["rng"]) == 2
    _assert_same_run(two, one_process, rtol=1e-5, atol=atol)
    assert _rows(two, "valid")[-1]["cer"] == pytest.approx(_rows(one_process, "valid")[-1]["cer"])
    if strategy == "fsdp":
        # A sharded run's checkpoint is whole: one process resumes it (at the same place in the
        # epoch).
        resumed = tmp_path / "resumed"
        err = _one_process(
            tiny_corpus,
            resumed,
            tokenizer_path,
            "--gradient_accumulation_steps",
            "2",
            *EXACT,
            "--resume",
            str(two / "step_0000003.pt"),
        )
        assert "written by 2 processes, this run has 1" in err and "after 6 of its batches" in err
        rows = _rows(resumed)
        assert [r["step"] for r in rows] == [4, 5, 6]
        for ra, rb in zip(rows, _rows(one_process)[3:], strict=True):
            assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-4), (ra, rb)


def test_sigterm_to_torchrun_saves_once_and_both_processes_resume_exactly(
    tiny_corpus, tokenizer_path, tmp_path
):
    """Dropout and SpecAugment on: the resumed run must restore each process's random state."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    args = ("--gradient_accumulation_steps", "1", "--max_steps", "12")
    proc = _torchrun(_args(tiny_corpus, whole, tokenizer_path, *args))
    assert proc.wait(timeout=600) == 0, proc.stdout.read()[-3000:]

    proc = _torchrun(_args(tiny_corpus, split, tokenizer_path, "--gradient_accumulation_steps", "1",
                           "--max_steps", "1000"))
    deadline = time.monotonic() + 600
    # read_metrics: the line being written may be cut short
    while (not (split / "metrics.jsonl").is_file()
           or len(read_metrics(split / "metrics.jsonl").get("train", [])) < 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # as a scheduler or a closing notebook would
    output = proc.communicate(timeout=300)[0]
    stopped = load_checkpoint(split / "latest.pt")
    step = stopped["step"]
    assert 3 <= step < 12 and stopped["batches_done"] > 0, output[-3000:]
    assert f"stopped by SIGTERM at step {step}" in output
    log = (split / "train.log").read_text()
    assert log.count(f"saved {split / f'step_{step:07d}.pt'}") == 1  # one save, by rank 0
    assert sorted(p.name for p in split.glob("step_*.pt")) == [f"step_{step:07d}.pt"]

    proc = _torchrun(_args(tiny_corpus, split, tokenizer_path, *args, "--resume", "latest"))
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, output[-3000:]
    assert f"resumed from latest at step {step}" in output
    resumed, unbroken = _rows(split), _rows(whole)
    assert [r["step"] for r in resumed] == list(range(1, 13))
    for a, b in zip(resumed, unbroken, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a, b)


def test_one_failing_process_ends_the_run_instead_of_hanging_the_others(
    tiny_corpus, tokenizer_path, tmp_path
):
    out = tmp_path / "fails"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(Path(__file__).parent / "fault_run.py"),
            "error_on_rank1_at_step",
            "3",
            "--",
            *_args(
                tiny_corpus,
                out,
                tokenizer_path,
                "--gradient_accumulation_steps",
                "1",
                "--max_steps",
                "1000",
            ),
        ],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output = proc.communicate(timeout=300)[0]  # a hang would run into the timeout
    assert proc.returncode != 0
    assert "injected failure of rank 1" in output


GROUP_SCRIPT = """
import sys
import torch.distributed as td
from konkanivani.training.distributed import distributed

if sys.argv[1] == "caller":  # the caller's own group outlives the block
    td.init_process_group("gloo")
with distributed("cpu") as (dist, device):
    total = dist.sum([dist.rank + 1.0])[0]
with open(f"{sys.argv[2]}/rank{dist.rank}.txt", "w") as f:
    f.write(f"sum {total:g}, group left {td.is_initialized()}")
if td.is_initialized():  # the caller's to destroy, as the block destroys its own
    td.barrier()
    td.destroy_process_group()
"""


@pytest.mark.parametrize("owner", ["block", "caller"])
def test_the_process_group_is_destroyed_by_whoever_made_it(owner, tmp_path):
    """A process that leaves with gloo's threads running aborts at interpreter exit, failing the
    run."""
    script = tmp_path / "group.py"
    script.write_text(GROUP_SCRIPT)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(script),
            owner,
            str(tmp_path),
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        assert (
            tmp_path / f"rank{rank}.txt"
        ).read_text() == f"sum 3, group left {owner == 'caller'}"
