import errno
import io
import os

import pytest
import torch

from konkanivani.checkpoint import (
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
    step_checkpoint_name,
)
from konkanivani.training.run_files import (
    point_to,
    prune_checkpoints,
    remove_stale_temporaries,
    resolve_resume,
)


def _state(step):
    return {
        "step": step,
        "model": {"w": torch.full((3,), float(step))},
        "tokenizer": b"\x00\x01bytes",
        "rng": {"python": (3, tuple(range(5)), None)},
    }


def test_save_load_round_trip_and_no_temporary_left(tmp_path):
    path = save_checkpoint(_state(5), tmp_path / step_checkpoint_name(5))
    assert path.name == "step_0000005.pt"
    state = load_checkpoint(path)
    assert state["step"] == 5 and state["tokenizer"] == b"\x00\x01bytes"
    assert torch.equal(state["model"]["w"], torch.full((3,), 5.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000005.pt"]


def test_failed_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "latest.pt"
    save_checkpoint(_state(1), path)

    for error in (
        OSError(28, "No space left on device"),
        RuntimeError("PytorchStreamWriter failed writing file"),
    ):
        def failing_save(*args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(torch, "save", failing_save)
        with pytest.raises(CheckpointError, match="No space left on device|failed writing"):
            save_checkpoint(_state(2), path)
        monkeypatch.undo()
    assert load_checkpoint(path)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.pt"]


def test_point_to_and_prune(tmp_path):
    for step in (10, 20, 30, 40):
        save_checkpoint(_state(step), tmp_path / step_checkpoint_name(step))
    point_to(tmp_path / "step_0000020.pt", tmp_path / "best.pt")
    point_to(tmp_path / "step_0000040.pt", tmp_path / "latest.pt")
    deleted = prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in deleted) == ["step_0000010.pt", "step_0000020.pt"]
    assert load_checkpoint(tmp_path / "best.pt")["step"] == 20  # survives its step file
    assert load_checkpoint(resolve_resume("latest", tmp_path))["step"] == 40


def test_truncated_or_foreign_files_give_clear_errors(tmp_path):
    path = save_checkpoint(_state(3), tmp_path / "a.pt")
    data = path.read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated, corrupt"):
        load_checkpoint(tmp_path / "cut.pt")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="not a konkanivani checkpoint"):
        load_checkpoint(tmp_path / "other.pt")
    torch.save({"format_version": 99}, tmp_path / "future.pt")
    with pytest.raises(CheckpointError, match="format 99"):
        load_checkpoint(tmp_path / "future.pt")
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_resume("latest", tmp_path / "empty")


def test_prune_keeps_the_newest_writes_after_resuming_an_older_step(tmp_path):
    for step in (200, 300, 400, 110):  # resumed from step 100, then saved step 110
        save_checkpoint(_state(step), tmp_path / step_checkpoint_name(step))
        os.utime(
            tmp_path / step_checkpoint_name(step),
            ns=(step * 10**9, (1000 + len(os.listdir(tmp_path))) * 10**9),
        )
    prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step_*.pt")) == [
        "step_0000110.pt",
        "step_0000400.pt",
    ]


def test_stale_temporaries_of_a_killed_process_are_removed(tmp_path):
    save_checkpoint(_state(1), tmp_path / "latest.pt")
    dead = tmp_path / ".step_0000002.pt.tmp4194999"  # left by a process killed while saving
    mine = tmp_path / f".latest.pt.tmp{os.getpid()}"  # this process may be writing it right now
    other = tmp_path / ".notes.txt.tmp12"
    for p in (dead, mine, other):
        p.write_bytes(b"half")
    assert remove_stale_temporaries(tmp_path) == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [mine.name, other.name, "latest.pt"]
    )


def test_train_state_round_trip_and_older_formats(tmp_path):
    from konkanivani.checkpoint import TrainState

    state = TrainState(
        model_config={"d_model": 8},
        train_config={"lr": 1e-3},
        tokenizer=b"sp",
        model={"w": torch.ones(2)},
        optimizer={"state": {}, "param_groups": []},
        step=7,
        epoch=1,
        batches_done=3,
        processes=2,
        rng=[{"a": 1}, {"a": 2}],
        best_wer=0.5,
        best_cer=0.2,
    )
    loaded = TrainState.load(state.save(tmp_path / "s.pt"))
    assert (loaded.step, loaded.epoch, loaded.batches_done, loaded.processes, loaded.best_cer) == (
        7,
        1,
        3,
        2,
        0.2,
    )
    assert torch.equal(loaded.model["w"], torch.ones(2)) and loaded.rng == [{"a": 1}, {"a": 2}]

    old = tmp_path / "old.pt"
    torch.save(
        {
            "format_version": 1,
            "model": {"w": torch.ones(2)},
            "model_config": {},
            "tokenizer": b"sp",
            "optimizer": {},
            "sampler": {"epoch": 0, "start": 0},
        },
        old,
    )
    # format 1 (before 0.1.0) is no longer read, for decoding or averaging either
    with pytest.raises(CheckpointError, match=r"has checkpoint format 1; this konkanivani reads "
                       r"format 2 only \(CHANGELOG.md\)$"):
        load_checkpoint(old)
    averaged = save_checkpoint(
        {"model": {"w": torch.ones(2)}, "model_config": {}, "tokenizer": b"sp"}, tmp_path / "avg.pt"
    )
    with pytest.raises(CheckpointError, match="model weights only"):
        TrainState.load(averaged)


needs_dev_full = pytest.mark.skipif(
    not os.path.exists("/dev/full"), reason="no /dev/full (Linux only)"
)


class _DiskFillsUp(io.FileIO):
    """A file on a disk with 4 KiB left: a write past that fails as write(2) does, with ENOSPC
    (unbuffered, as a large write that bypasses Python's buffer, so closing the file succeeds)."""

    def write(self, data):
        if self.tell() + len(data) > 4096:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(data)


def test_a_full_disk_is_reported_as_such_not_in_torch_words(tmp_path, monkeypatch):
    """torch.save turns the OSError of a write into a RuntimeError of its own ("[enforce fail at
    inline_container.cc:...] unexpected pos ..."); the message gives the system's reason."""
    from konkanivani import checkpoint

    path = tmp_path / "latest.pt"
    save_checkpoint(_state(1), path)
    monkeypatch.setattr(
        checkpoint, "open", lambda name, mode: _DiskFillsUp(name, mode), raising=False
    )
    with pytest.raises(CheckpointError) as error:
        save_checkpoint({**_state(2), "model": {"w": torch.zeros(100_000)}}, path)
    # torch's words, which the message does not repeat
    assert isinstance(error.value.__cause__, RuntimeError)
    assert (
        str(error.value)
        == f"could not write checkpoint {path}: No space left on device; the previous "
        "checkpoints are untouched"
    )
    assert load_checkpoint(path)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.pt"]


@needs_dev_full
def test_a_full_disk_under_the_metrics_log_is_a_checkpoint_error(tmp_path):
    from konkanivani.training.metrics_log import MetricsLog

    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")
    with pytest.raises(CheckpointError, match="metrics.jsonl: No space left on device"):
        MetricsLog(tmp_path / "metrics.jsonl").write("train", 1, 1, loss=1.0)


def test_a_checkpoint_path_under_a_file_is_a_checkpoint_error(tmp_path):
    """konkanivani-average --output FILE/avg.pt, say: one line, not a NotADirectoryError
    traceback."""
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="could not write checkpoint .*file/avg.pt: "):
        save_checkpoint(_state(1), tmp_path / "file" / "avg.pt")
