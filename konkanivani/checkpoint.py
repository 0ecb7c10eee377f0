"""Checkpoint files that survive a crash: written to a temporary file, fsynced, renamed into
place; read back with ``weights_only`` (no pickled code runs) and refused in one line when they are
not konkanivani checkpoints. The run directory around them (step files, ``latest.pt``, the lock)
is ``training.run_files``; what a training checkpoint holds is ``training.state.TrainState``.
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch

from .config import checkpoint_file_error

__all__ = [
    "CheckpointError",
    "FORMAT_VERSION",
    "atomic_file",
    "average_checkpoints",
    "fsync_dir",
    "inference_state_dict",
    "load_checkpoint",
    "save_checkpoint",
    "temporary_path",
    "write_file_atomic",
]

log = logging.getLogger("konkanivani")


FORMAT_VERSION = 2  # 2: TrainState (no LR scheduler state: the LR is a function of the step)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message says which file and why."""


def inference_state_dict(checkpoint: dict[str, Any], ema: bool = True) -> dict[str, Any]:
    """The weights to decode (or fine-tune) with: the EMA weights where the run kept them (``ema``),
    else the training weights. ``model`` stays the raw training weights, as resuming needs them."""
    return (checkpoint.get("ema_model") or checkpoint["model"]) if ema else checkpoint["model"]


def temporary_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some file systems (and Windows) cannot open a directory
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[BinaryIO]:
    """A binary file to write ``path`` through: a temporary file beside it, fsynced and renamed into
    place when the block ends, removed if the block raises. A reader sees the old file or the
    new one, never half."""
    path = Path(path)
    tmp = temporary_path(path)
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


class _KeepsWriteError:
    """A binary file that remembers the first ``OSError`` its ``write`` raised. torch.save turns
    such an error into a RuntimeError of its own ("[enforce fail at inline_container.cc:...]
    unexpected pos 704 vs 598"), which hides the reason: "No space left on device"."""

    def __init__(self, f: BinaryIO):
        self.f, self.error = f, None

    def write(self, data: bytes) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def __getattr__(self, name: str) -> Any:  # flush, fileno, ...: the file's own
        return getattr(self.f, name)


def save_checkpoint(state: dict[str, Any], path: str | Path) -> Path:
    """Write ``state`` to ``path`` atomically: a reader sees the old file or the new one, never
    half.
    ``CheckpointError`` when it cannot be written, with the system's reason (a full disk, say)."""
    path = Path(path)
    f = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as raw:
            f = _KeepsWriteError(raw)
            torch.save({"format_version": FORMAT_VERSION, **state}, f)
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as either
        cause = f.error if f is not None and f.error is not None else e
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else cause
        raise CheckpointError(f"could not write checkpoint {path}: {reason}; "
                              "the previous checkpoints are untouched") from e
    return path


def write_file_atomic(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` as checkpoints are written (``atomic_file``)."""
    path = Path(path)
    try:
        with atomic_file(path) as f:
            f.write(data)
    except OSError as e:
        raise CheckpointError(f"could not write {path}: {e.strerror or e}") from e
    return path


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a konkanivani checkpoint; ``CheckpointError`` with a plain reason if it is not one."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(checkpoint_file_error(path))
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"cannot read checkpoint {path}: the file is truncated, corrupt or not a "
            f"PyTorch checkpoint ({type(e).__name__})"
        ) from e
    if not isinstance(state, dict) or "format_version" not in state:
        raise CheckpointError(f"{path} is not a konkanivani checkpoint")
    if state["format_version"] != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format {state['format_version']}; this konkanivani "
            f"reads format {FORMAT_VERSION} only (CHANGELOG.md)"
        )
    return state


def average_checkpoints(paths: list[str | Path]) -> dict[str, Any]:
    """A checkpoint whose weights are the mean of those in ``paths`` (same model shape), for
    decoding; optimizer and schedule state are left out, so it cannot be resumed."""
    if not paths:
        raise CheckpointError("no checkpoint to average")
    total: dict[str, torch.Tensor] = {}
    first = None
    for p in paths:
        state = load_checkpoint(p)
        if first is None:
            first = state
        elif (
            state["model_config"] != first["model_config"]
            or state["tokenizer"] != first["tokenizer"]
        ):
            raise CheckpointError(
                f"{p}: model shape or tokenizer differs from {paths[0]}; cannot average"
            )
        for name, tensor in state["model"].items():
            if name not in total:
                total[name] = tensor.double() if tensor.is_floating_point() else tensor.clone()
            elif tensor.is_floating_point():
                total[name] += tensor.double()
    averaged = {
        name: (t / len(paths)).to(first["model"][name].dtype) if t.is_floating_point() else t
        for name, t in total.items()
    }
    keep = ("model_config", "train_config", "tokenizer", "step")
    return {**{k: first[k] for k in keep if k in first}, "model": averaged,
            "averaged_from": [str(p) for p in paths]}
