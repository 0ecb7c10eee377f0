"""Checkpoints that survive a crash: written to a temporary file, fsynced, renamed into place.

Layout of an output directory::

    step_0000160.pt   one per save (each epoch and every --save_every_steps), last N kept
    latest.pt         the newest complete save
    best.pt           the save with the lowest validation WER
    config.yaml       every setting the run uses, for --config (``config_file.py``; rewritten on resume)
    .lock             held by the run that writes here (``hold_run_directory``)

``latest.pt`` and ``best.pt`` are hard links to a step file where the file system allows it (no
extra disk), copies otherwise; either way they are replaced by an atomic rename.

A directory holds one run: a second process that starts in it is refused while the first runs
(``hold_run_directory``), and a fresh start into a directory that already holds a run (any ``*.pt``
file counts) is refused unless asked for, when the old run is moved aside, never deleted
(``check_output_dir``, ``existing_run``, ``move_run_aside``). A run refused, or stopped before it
wrote anything, leaves the directory as it found it.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; the directory is then not guarded
    fcntl = None

__all__ = ["CheckpointError", "FORMAT_VERSION", "LOCK_FILE", "TrainState", "capture_rng", "restore_rng",
           "save_checkpoint", "load_checkpoint", "point_to", "prune_checkpoints", "remove_stale_temporaries",
           "resolve_resume", "load_resume_checkpoint", "step_checkpoint_name", "step_checkpoints",
           "select_checkpoints", "average_checkpoints", "hold_run_directory", "check_output_dir", "claim_output_dir",
           "existing_run", "move_run_aside", "MetricsLog", "atomic_file", "write_file_atomic", "inference_state_dict"]

log = logging.getLogger("konkanivani")

LOCK_FILE = ".lock"

FORMAT_VERSION = 2  # 2: TrainState (no LR scheduler state: the LR is a function of the step)
_READABLE_FORMATS = (1, 2)  # format 1 still serves decoding and averaging: its model fields are the same
_STEP_FILE = re.compile(r"step_(\d+)\.pt$")
_TEMPORARY = re.compile(r"^\..+\.pt\.tmp(\d+)$")  # ".NAME.pt.tmpPID", see _temporary


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message says which file and why."""


@dataclass
class TrainState:
    """Everything a run needs to go on exactly where it stopped; the checkpoint *is* this, as a dict
    of its fields (``save``/``load``). ``model``, ``optimizer`` and ``scaler`` are state dicts;
    ``rng`` holds the random states of each process of the run (``capture_rng``)."""

    model_config: dict[str, Any]
    train_config: dict[str, Any]
    tokenizer: bytes  # the SentencePiece model
    model: dict[str, Any]
    optimizer: dict[str, Any] = field(default_factory=dict)
    scaler: dict[str, Any] = field(default_factory=dict)  # empty unless fp16
    step: int = 0  # optimizer steps done
    epoch: int = 0  # epochs finished
    batches_done: int = 0  # batches of the epoch in progress already trained on, by each process
    processes: int = 1  # of the run that wrote it (torchrun's world size)
    rng: list[dict[str, Any]] = field(default_factory=list)  # one per process (rank)
    best_wer: float = math.inf
    best_cer: float = math.inf
    valid_metrics: dict[str, float] = field(default_factory=dict)
    valid_step: int = -1  # the step valid_metrics were measured at
    ema_model: dict[str, Any] = field(default_factory=dict)  # the EMA weights (--ema_decay); empty when off
    ema_updates: int = 0  # optimizer steps averaged into ema_model (AveragedModel.n_averaged)

    def save(self, path: str | Path) -> Path:
        return save_checkpoint({f.name: getattr(self, f.name) for f in fields(self)}, path)

    @classmethod
    def load(cls, path: str | Path) -> TrainState:
        return cls.from_checkpoint(load_checkpoint(path), path)

    @classmethod
    def from_checkpoint(cls, state: dict[str, Any], path: str | Path) -> TrainState:
        """The training state of a loaded checkpoint; ``CheckpointError`` in one line for one that
        cannot be resumed (an older format, averaged weights)."""
        if state["format_version"] != FORMAT_VERSION:
            raise CheckpointError(f"{path} has checkpoint format {state['format_version']} (an older konkanivani); "
                                  f"training resumes format {FORMAT_VERSION} only. Its weights still serve "
                                  "transcribe, evaluate and average")
        if "optimizer" not in state:
            raise CheckpointError(f"{path} holds model weights only (an averaged model?); resume from a step "
                                  "checkpoint or latest")
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        if missing := [name for name in required if name not in state]:
            raise CheckpointError(f"{path} is not a speech recognition training checkpoint (no {', '.join(missing)}; "
                                  "a language model's?)")
        # A field added after the format (ema_model, say) is absent from older files: its default.
        return cls(**{f.name: state[f.name] for f in fields(cls) if f.name in state})


def inference_state_dict(checkpoint: dict[str, Any], ema: bool = True) -> dict[str, Any]:
    """The weights to decode (or fine-tune) with: the EMA weights where the run kept them (``ema``),
    else the training weights. ``model`` stays the raw training weights, as resuming needs them."""
    return (checkpoint.get("ema_model") or checkpoint["model"]) if ema else checkpoint["model"]


def capture_rng() -> dict[str, Any]:
    """This process's random states: Python, NumPy, torch (CPU and CUDA)."""
    np_state = np.random.get_state()
    return {"python": random.getstate(), "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class MetricsLog:
    """``OUTPUT_DIR/metrics.jsonl``: one JSON object a line (``kind``, ``step``, ``epoch`` and the figures)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def write(self, kind: str, step: int, epoch: int, **values: float) -> None:
        values = {k: v if math.isfinite(v) else None for k, v in values.items()}  # strict JSON: no NaN
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"kind": kind, "step": step, "epoch": epoch, **values}) + "\n")
        except OSError as e:  # a full disk, say: one line naming the file, not a traceback
            raise CheckpointError(f"could not write {self.path}: {e.strerror or e}") from e

    def truncate(self, step: int) -> None:
        """Drop the rows written after ``step`` by a run that died before its next save, and a
        line cut short by a kill."""
        if not self.path.is_file():
            return
        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [line for line in lines if _metric_step(line) <= step]
        if len(kept) < len(lines):
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(kept), encoding="utf-8")
            os.replace(tmp, self.path)


def _metric_step(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return math.inf


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


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[BinaryIO]:
    """A binary file to write ``path`` through: a temporary file beside it, fsynced and renamed into
    place when the block ends, removed if the block raises. A reader sees the old file or the
    new one, never half."""
    path = Path(path)
    tmp = _temporary(path)
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


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
    """Write ``state`` to ``path`` atomically: a reader sees the old file or the new one, never half.
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
    files = _by_write_time(Path(directory))
    doomed = files[:max(0, len(files) - keep)]
    for p in doomed:
        p.unlink(missing_ok=True)
    return doomed


def _by_write_time(directory: Path) -> list[Path]:
    """The step files in ``directory``, oldest write first (ties by step); files that vanish while
    being listed are left out."""
    found = []
    for p in directory.glob("step_*.pt"):
        if m := _STEP_FILE.search(p.name):
            with contextlib.suppress(FileNotFoundError):
                found.append((p.stat().st_mtime_ns, int(m.group(1)), p))
    return [p for _, _, p in sorted(found)]


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
    if state["format_version"] not in _READABLE_FORMATS:
        raise CheckpointError(f"{path} has checkpoint format {state['format_version']}; this konkanivani "
                              f"reads formats {', '.join(map(str, _READABLE_FORMATS))}")
    return state


def resolve_resume(resume: str, output_dir: str | Path) -> Path:
    """``latest`` means ``OUTPUT_DIR/latest.pt``; anything else is a path."""
    path = Path(output_dir) / "latest.pt" if resume == "latest" else Path(resume)
    if not path.is_file():
        raise CheckpointError(f"--resume {resume}: {path} does not exist")
    return path


def load_resume_checkpoint(resume: str, output_dir: str | Path) -> tuple[dict[str, Any], Path]:
    """The checkpoint ``--resume`` names, loaded, and its path.

    ``latest`` falls back, with a warning, to the newest readable step file of ``output_dir`` (by
    write time, as pruning counts) when ``latest.pt`` is missing or cannot be read: a sync tool
    may truncate a file, and the step file it pointed to, or the one before, is usually whole.
    A path given outright is loaded or refused, never replaced by another file.
    """
    if resume != "latest":
        path = resolve_resume(resume, output_dir)
        return load_checkpoint(path), path
    latest = Path(output_dir) / "latest.pt"
    broken: list[str] = []
    try:
        return load_checkpoint(latest), latest
    except CheckpointError as e:
        if latest.exists():
            broken.append(str(e))
            latest_inode = latest.stat().st_ino
        else:
            latest_inode = None
    for path in reversed(_by_write_time(Path(output_dir))):
        with contextlib.suppress(FileNotFoundError):
            if path.stat().st_ino == latest_inode:  # the step file latest.pt is a hard link to: broken too
                continue
        try:
            state = load_checkpoint(path)
        except CheckpointError as e:
            broken.append(str(e))
            continue
        log.warning("--resume latest: %s; resuming from %s, the newest readable checkpoint",
                    "; ".join(broken) if broken else f"{latest} does not exist", path)
        return state, path
    if not broken:
        raise CheckpointError(f"--resume latest: {latest} does not exist (no checkpoint in {output_dir})")
    raise CheckpointError(f"--resume latest: no readable checkpoint in {output_dir}: " + "; ".join(broken))


@contextlib.contextmanager
def hold_run_directory(directory: str | Path) -> Iterator[None]:
    """Hold ``directory`` for this process while the block runs: an exclusive lock on
    ``directory/.lock``, which the kernel releases on any exit, kill -9 included. Raises
    ``CheckpointError`` naming the holder when another process holds it, and saying why when the
    directory cannot be made or written to.

    The directory (and its missing parents) and the lock file are made where missing. A block that
    adds or removes nothing in the directory (a run refused, or one stopped before it wrote
    anything) leaves it as it was found: what this call made is removed again on the way out.

    A POSIX record lock (``lockf``) rather than ``flock``: forked DataLoader workers do not inherit
    it, so the lock ends with the training process itself, not with its last worker."""
    directory = Path(directory)
    made = _make_directory(directory)
    try:
        if fcntl is None:
            yield
            return
        found = _names(directory) or set()
        fd, made_lock = _take_lock(directory)
        try:
            yield
        finally:
            if made_lock and _names(directory) == found | {LOCK_FILE}:  # the block changed nothing
                (directory / LOCK_FILE).unlink(missing_ok=True)  # while held: see _take_lock for a waiting process
            os.close(fd)  # releases the lock
    finally:
        _remove_empty(made)


def _make_directory(directory: Path) -> list[Path]:
    """Make ``directory`` and its missing parents; return those made, innermost first.
    ``CheckpointError`` saying why when it cannot be made or written to."""
    made, existing = [], directory
    while not existing.exists() and existing != existing.parent:
        made.append(existing)
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise CheckpointError(f"cannot use {directory} as the output directory: {existing} is a file")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _remove_empty(made)  # the parents made before the failure
        raise CheckpointError(f"cannot make the output directory {directory}: {e.strerror or e}") from e
    if not os.access(directory, os.W_OK | os.X_OK):  # for root, only a read-only file system says no
        _remove_empty(made)
        raise CheckpointError(f"cannot write to the output directory {directory}: permission denied or a "
                              "read-only file system; give another --output_dir")
    return made


def _remove_empty(directories: list[Path]) -> None:
    """Remove ``directories`` (innermost first) while they are empty."""
    for d in directories:
        try:
            d.rmdir()
        except OSError:
            return


def _names(directory: Path) -> set[str] | None:
    try:
        return set(os.listdir(directory))
    except OSError:
        return None


def _take_lock(directory: Path) -> tuple[int, bool]:
    """The open, locked ``directory/.lock`` with this process's id in it, and whether it was made here.

    A holder that made the lock file removes it as it lets go (``hold_run_directory``); a process
    that opened the file just before and locks it once it is released holds a file no longer in
    the directory, so it checks that the one it locked is still the one there, and tries again
    when not."""
    path = directory / LOCK_FILE
    for _ in range(10):
        try:
            try:
                fd, made = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:
                fd, made = os.open(path, os.O_RDWR), False
        except FileNotFoundError:  # removed between the two opens, or the directory with it
            directory.mkdir(parents=True, exist_ok=True)
            continue
        except OSError as e:
            raise CheckpointError(f"cannot write to the output directory {directory}: {e.strerror or e}") from e
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 200).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise CheckpointError(f"{directory} is in use by another training run ({holder}); wait for it to end, "
                                  "or give this run another --output_dir") from None
        try:
            current = os.stat(path).st_ino
        except FileNotFoundError:
            current = None
        if current != os.fstat(fd).st_ino:  # its holder removed it as it let go: take the new one
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        return fd, made
    raise CheckpointError(f"could not lock {path}: other processes keep replacing it")


def check_output_dir(directory: str | Path, resume: str, overwrite: bool) -> bool:
    """Whether a run may start in ``directory``, without changing anything: a fresh run never
    writes over an earlier one, so where ``directory`` holds a run and this one does not resume
    it, it is refused (``CheckpointError``) unless ``overwrite``. True when the earlier run must
    first be moved aside (``move_run_aside``)."""
    directory = Path(directory)
    if resume or (found := existing_run(directory)) is None:
        return False
    if not overwrite:
        raise CheckpointError(f"{directory} already holds a run ({found}): continue it with --resume latest, or "
                              f"start a new one with --overwrite (moves the old run to {directory.name}.replaced-<time>/ "
                              "beside it; nothing is deleted) or with another --output_dir")
    return True


def claim_output_dir(directory: str | Path, resume: str, overwrite: bool) -> Path | None:
    """``check_output_dir``, then the earlier run moved aside where it must be: the folder it went
    to is returned (None when nothing was moved)."""
    return move_run_aside(directory) if check_output_dir(directory, resume, overwrite) else None


def existing_run(directory: str | Path) -> str | None:
    """What of an earlier run ``directory`` holds (checkpoints, training metrics), said in a few
    words; None when there is nothing to lose (a tokenizer or log of a run that never saved). Any
    ``*.pt`` counts, not only the run's own: a lone best.pt, or a checkpoint a user put there."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    steps = step_checkpoints(directory)
    counted = {"latest.pt", *(p.name for _, p in steps)}
    others = sorted(p.name for p in directory.glob("*.pt") if p.is_file() and p.name not in counted)
    found = ["latest.pt"] if (directory / "latest.pt").exists() else []
    if steps:
        found.append(f"{len(steps)} step checkpoint{'s' if len(steps) > 1 else ''} (up to {steps[-1][1].name})")
    found += others
    metrics = directory / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append("metrics.jsonl")
    return ", ".join(found) or None


def move_run_aside(directory: str | Path) -> Path:
    """Move everything in ``directory`` but its lock into a new sibling folder named after it and
    the time (``run.replaced-20260101-120000``), and return that folder. Nothing is deleted.
    ``CheckpointError`` saying where things are when the move fails (no room for the folder
    beside it, say)."""
    directory = Path(directory)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = directory.with_name(f"{directory.name}.replaced-{stamp}")
    n = 1
    while aside.exists():
        n += 1
        aside = directory.with_name(f"{directory.name}.replaced-{stamp}-{n}")
    try:
        aside.mkdir()
        for entry in directory.iterdir():
            if entry.name != LOCK_FILE:
                os.replace(entry, aside / entry.name)
    except OSError as e:
        where = f"; what was moved is in {aside}" if aside.is_dir() and any(aside.iterdir()) else ""
        raise CheckpointError(f"--overwrite could not move the run in {directory} aside to {aside}: "
                              f"{e.strerror or e}{where}") from e
    _fsync_dir(directory)
    _fsync_dir(aside)
    return aside


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
