"""Checkpoints that survive a crash: written to a temporary file, fsynced, renamed into place.

Layout of an output directory::

    step_0000160.pt   one per save (each epoch and every --save_every_steps), last N kept
    latest.pt         the newest complete save
    best.pt           the save with the lowest validation WER

``latest.pt`` and ``best.pt`` are hard links to a step file where the file system allows it (no
extra disk), copies otherwise; either way they are replaced by an atomic rename.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

__all__ = ["CheckpointError", "FORMAT_VERSION", "save_checkpoint", "load_checkpoint", "point_to",
           "prune_checkpoints", "remove_stale_temporaries", "resolve_resume", "step_checkpoint_name",
           "step_checkpoints", "select_checkpoints", "average_checkpoints"]

FORMAT_VERSION = 1
_STEP_FILE = re.compile(r"step_(\d+)\.pt$")
_TEMPORARY = re.compile(r"^\..+\.pt\.tmp(\d+)$")  # ".NAME.pt.tmpPID", see _temporary


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message says which file and why."""


def step_checkpoint_name(step: int) -> str:
    return f"step_{step:07d}.pt"


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def _fsync_dir(directory: Path) -> None:
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


def save_checkpoint(state: dict[str, Any], path: str | Path) -> Path:
    """Write ``state`` to ``path`` atomically: a reader sees the old file or the new one, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(path)
    try:
        with open(tmp, "wb") as f:
            torch.save({"format_version": FORMAT_VERSION, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        # torch.save reports a failed write (a full disk, say) as OSError or RuntimeError.
        if isinstance(e, (OSError, RuntimeError)):
            reason = e.strerror if isinstance(e, OSError) and e.strerror else e
            raise CheckpointError(f"could not write checkpoint {path}: {reason}; "
                                  "the previous checkpoints are untouched") from e
        raise
    _fsync_dir(path.parent)
    return path


def point_to(target: str | Path, link: str | Path) -> None:
    """Make ``link`` (e.g. latest.pt) the same file as ``target``, atomically."""
    target, link = Path(target), Path(link)
    tmp = _temporary(link)
    tmp.unlink(missing_ok=True)
    try:
        try:
            os.link(target, tmp)
        except OSError:  # no hard links here (some network and FUSE mounts): copy instead
            with open(target, "rb") as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, 16 << 20)
                dst.flush()
                os.fsync(dst.fileno())
        os.replace(tmp, link)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"could not update {link}: {e.strerror or e}") from e
    _fsync_dir(link.parent)


def prune_checkpoints(directory: str | Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` most recently written step files; return the deleted paths.

    By write time rather than step number: after resuming from an older checkpoint, the files of
    the abandoned later steps go first, not the new ones.
    """
    files = sorted((p.stat().st_mtime_ns, int(m.group(1)), p) for p in Path(directory).glob("step_*.pt")
                   if (m := _STEP_FILE.search(p.name)))
    doomed = [p for _, _, p in files[:max(0, len(files) - keep)]]
    for p in doomed:
        p.unlink(missing_ok=True)
    return doomed


def remove_stale_temporaries(directory: str | Path) -> list[Path]:
    """Delete the half-written temporaries of an earlier process killed while saving (kill -9, power
    loss); they were never renamed into place, so no checkpoint refers to them."""
    stale = [p for p in Path(directory).glob(".*.pt.tmp*")
             if (m := _TEMPORARY.match(p.name)) and int(m.group(1)) != os.getpid()]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a konkanivani checkpoint; ``CheckpointError`` with a plain reason if it is not one."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint {path}: the file is truncated, corrupt or not a "
                              f"PyTorch checkpoint ({type(e).__name__})") from e
    if not isinstance(state, dict) or "format_version" not in state:
        raise CheckpointError(f"{path} is not a konkanivani checkpoint")
    if state["format_version"] != FORMAT_VERSION:
        raise CheckpointError(f"{path} has checkpoint format {state['format_version']}; this konkanivani "
                              f"reads format {FORMAT_VERSION}")
    return state


def resolve_resume(resume: str, output_dir: str | Path) -> Path:
    """``latest`` means ``OUTPUT_DIR/latest.pt``; anything else is a path."""
    path = Path(output_dir) / "latest.pt" if resume == "latest" else Path(resume)
    if not path.is_file():
        raise CheckpointError(f"--resume {resume}: {path} does not exist")
    return path


def step_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of the step files in ``directory``, by step."""
    return sorted((int(m.group(1)), p) for p in Path(directory).glob("step_*.pt") if (m := _STEP_FILE.search(p.name)))


def select_checkpoints(directory: str | Path, last: int = 0, best: int = 0) -> list[Path]:
    """The ``last`` N step files, or the ``best`` N by the validation WER measured at their own step
    (the saves at the end of an epoch)."""
    found = step_checkpoints(directory)
    if last:
        return [p for _, p in found[-last:]]
    scored = []
    for step, p in found:
        state = load_checkpoint(p)
        if state.get("valid_step") == step and state["valid_metrics"]:
            scored.append((state["valid_metrics"]["wer"], -step, p))
    return [p for _, _, p in sorted(scored)[:best]]


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
        elif state["model_config"] != first["model_config"] or state["tokenizer"] != first["tokenizer"]:
            raise CheckpointError(f"{p}: model shape or tokenizer differs from {paths[0]}; cannot average")
        for name, tensor in state["model"].items():
            if name not in total:
                total[name] = tensor.double() if tensor.is_floating_point() else tensor.clone()
            elif tensor.is_floating_point():
                total[name] += tensor.double()
    averaged = {name: (t / len(paths)).to(first["model"][name].dtype) if t.is_floating_point() else t
                for name, t in total.items()}
    keep = ("model_config", "train_config", "tokenizer", "step")
    return {**{k: first[k] for k in keep if k in first}, "model": averaged,
            "averaged_from": [str(p) for p in paths]}
