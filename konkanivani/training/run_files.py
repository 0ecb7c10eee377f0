"""The run directory: where a training run keeps its checkpoints, and how it never loses one.

Layout of an output directory::

    step_0000160.pt   one per save (each epoch and every --save_every_steps), last N kept
    latest.pt         the newest complete save
    best.pt           the save with the lowest validation WER
    config.yaml       every setting the run uses, for --config (``config_file.py``; rewritten on
                      resume)
    .lock             held by the run that writes here (``hold_run_directory``)

The names, and what each checkpoint holds, are ``checkpoint``'s.

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
import logging
import logging.handlers
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..checkpoint import (
    BEST_FILE,
    LATEST_FILE,
    METRICS_FILE,
    STEP_FILES,
    TEMPORARY_CHECKPOINTS,
    CheckpointError,
    fsync_dir,
    load_checkpoint,
    step_checkpoint_name,
    step_of,
    temporary_path,
    temporary_writer,
    validated_wer,
)
from ..config import TrainConfig, parse_mix
from ..data.manifest import input_inside, manifest_audio
from ..data.shards import shard_files
from .distributed import Dist

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; the directory is then not guarded
    fcntl = None

__all__ = [
    "LOCK_FILE",
    "overwrite_refusal",
    "run_directory",
    "save_step",
    "check_output_dir",
    "existing_run",
    "hold_run_directory",
    "load_resume_checkpoint",
    "move_run_aside",
    "point_to",
    "prune_checkpoints",
    "remove_stale_temporaries",
    "resolve_resume",
    "select_checkpoints",
    "step_checkpoints",
]

log = logging.getLogger("konkanivani")


LOCK_FILE = ".lock"


def point_to(target: str | Path, link: str | Path) -> None:
    """Make ``link`` (e.g. latest.pt) the same file as ``target``, atomically."""
    target, link = Path(target), Path(link)
    tmp = temporary_path(link)
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
    fsync_dir(link.parent)


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
    for p in directory.glob(STEP_FILES):
        if (step := step_of(p.name)) is not None:
            with contextlib.suppress(FileNotFoundError):
                found.append((p.stat().st_mtime_ns, step, p))
    return [p for _, _, p in sorted(found)]


def remove_stale_temporaries(directory: str | Path) -> list[Path]:
    """Delete the half-written temporaries of an earlier process killed while saving (kill -9, power
    loss); they were never renamed into place, so no checkpoint refers to them."""
    stale = [p for p in Path(directory).glob(TEMPORARY_CHECKPOINTS)
             if (pid := temporary_writer(p.name)) is not None and pid != os.getpid()]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def resolve_resume(resume: str, output_dir: str | Path) -> Path:
    """``latest`` means ``OUTPUT_DIR/latest.pt``; anything else is a path."""
    path = Path(output_dir) / LATEST_FILE if resume == "latest" else Path(resume)
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
    latest = Path(output_dir) / LATEST_FILE
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
            # the step file latest.pt is a hard link to: broken too
            if path.stat().st_ino == latest_inode:
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
        raise CheckpointError(
            f"--resume latest: {latest} does not exist (no checkpoint in {output_dir})"
        )
    raise CheckpointError(
        f"--resume latest: no readable checkpoint in {output_dir}: " + "; ".join(broken)
    )


@contextlib.contextmanager
def hold_run_directory(directory: str | Path, what: str = "training run") -> Iterator[None]:
    """Hold ``directory`` for this process while the block runs: an exclusive lock on
    ``directory/.lock``, which the kernel releases on any exit, kill -9 included. Raises
    ``CheckpointError`` naming the holder when another process holds it (``what`` names the kind
    of run that holds such folders: a training run, a labelling run), and saying why when the
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
        fd, made_lock = _take_lock(directory, what)
        try:
            yield
        finally:
            if made_lock and _names(directory) == found | {LOCK_FILE}:  # the block changed nothing
                # while held: see _take_lock for a waiting process
                (directory / LOCK_FILE).unlink(missing_ok=True)
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
        raise CheckpointError(
            f"cannot use {directory} as the output directory: {existing} is a file"
        )
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _remove_empty(made)  # the parents made before the failure
        raise CheckpointError(
            f"cannot make the output directory {directory}: {e.strerror or e}"
        ) from e
    # for root, only a read-only file system says no
    if not os.access(directory, os.W_OK | os.X_OK):
        _remove_empty(made)
        raise CheckpointError(
            f"cannot write to the output directory {directory}: permission denied or a "
            "read-only file system; give another --output_dir"
        )
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


def _take_lock(directory: Path, what: str) -> tuple[int, bool]:
    """The open, locked ``directory/.lock`` with this process's id in it, and whether it was made
    here.

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
            raise CheckpointError(
                f"cannot write to the output directory {directory}: {e.strerror or e}"
            ) from e
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 200).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise CheckpointError(
                f"{directory} is in use by another {what} ({holder}); wait for it to end, "
                "or give this run another --output_dir"
            ) from None
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
        advice = _how_to_continue(directory)
        raise CheckpointError(
            f"{directory} already holds a run ({found}): {advice}start a new one with --overwrite"
            f" (moves the old run to {directory.name}.replaced-<time>/ beside it; nothing is"
            " deleted) or with another --output_dir"
        )
    return True


def _how_to_continue(directory: Path) -> str:
    """The ``--resume`` that continues the run in ``directory``, as advice: ``latest`` where there
    is a latest.pt or a step file (it falls back to those), else the path of a lone checkpoint
    (best.pt first), which ``latest`` would not find; nothing where no checkpoint was saved."""
    if (directory / LATEST_FILE).exists() or step_checkpoints(directory):
        return "continue it with --resume latest, or "
    lone = sorted((p.name for p in directory.glob("*.pt") if p.is_file()),
                  key=lambda name: (name != BEST_FILE, name))
    if lone:
        return f"continue from its checkpoint with --resume {directory / lone[0]}, or "
    return "no checkpoint to resume from; "


def existing_run(directory: str | Path) -> str | None:
    """What of an earlier run ``directory`` holds (checkpoints, training metrics), said in a few
    words; None when there is nothing to lose (a tokenizer or log of a run that never saved). Any
    ``*.pt`` counts, not only the run's own: a lone best.pt, or a checkpoint a user put there."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    steps = step_checkpoints(directory)
    counted = {LATEST_FILE, *(p.name for _, p in steps)}
    others = sorted(p.name for p in directory.glob("*.pt") if p.is_file() and p.name not in counted)
    found = [LATEST_FILE] if (directory / LATEST_FILE).exists() else []
    if steps:
        found.append(
            f"{len(steps)} step checkpoint{'s' if len(steps) > 1 else ''} (up to"
            f" {steps[-1][1].name})"
        )
    found += others
    metrics = directory / METRICS_FILE
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append(METRICS_FILE)
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
        raise CheckpointError(
            f"--overwrite could not move the run in {directory} aside to {aside}: "
            f"{e.strerror or e}{where}"
        ) from e
    fsync_dir(directory)
    fsync_dir(aside)
    return aside


def step_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of the step files in ``directory``, by step."""
    return sorted(
        (step, p) for p in Path(directory).glob(STEP_FILES) if (step := step_of(p.name)) is not None
    )


def select_checkpoints(directory: str | Path, last: int = 0, best: int = 0) -> list[Path]:
    """The ``last`` N step files, or the ``best`` N by the validation WER measured at their own step
    (the saves at the end of an epoch)."""
    found = step_checkpoints(directory)
    if last:
        return [p for _, p in found[-last:]]
    scored = []
    for step, p in found:
        if (wer := validated_wer(load_checkpoint(p), step)) is not None:
            scored.append((wer, -step, p))
    return [p for _, _, p in sorted(scored)[:best]]


@contextlib.contextmanager
def run_directory(out_dir: Path, resume: str, overwrite: bool, dist: Dist = Dist(),
                  log_name: str = "train.log") -> Iterator[Callable[[], None]]:
    """Hold ``out_dir`` (one run at a time) and refuse at once to write over an earlier run unless
    asked to; yield ``start``, for the trainer to call once the data is known usable. Only then
    does the directory become this run's: an earlier run is moved aside (--overwrite) and
    ``log_name`` opened, with the lines logged before it. Both trainers (the ASR model's and the
    LM's) run in it. A run that fails before leaves the
    directory as it found it. The other processes of a data-parallel run wait for rank 0's
    check, and log errors only."""
    with hold_run_directory(out_dir) if dist.is_main else contextlib.nullcontext():
        replace = check_output_dir(out_dir, resume, overwrite) if dist.is_main else False
        dist.barrier()
        early = logging.handlers.MemoryHandler(
            1 << 30, flushLevel=logging.CRITICAL + 1, flushOnClose=False
        )
        handlers, level = [early], log.level
        if dist.is_main:
            log.addHandler(early)
        else:
            log.setLevel(logging.ERROR)

        def start() -> None:
            if not dist.is_main:
                return
            moved_to = move_run_aside(out_dir) if replace else None
            handlers.append(_log_file(out_dir / log_name))
            early.setTarget(handlers[-1])
            early.flush()
            log.removeHandler(early)
            log.addHandler(handlers[-1])
            if moved_to is not None:
                log.warning(
                    "--overwrite: the previous run in %s was moved to %s", out_dir, moved_to
                )
        try:
            yield start
        finally:
            log.setLevel(level)
            for handler in handlers:
                log.removeHandler(handler)
                handler.close()


def _log_file(path: Path) -> logging.Handler:
    try:
        handler = logging.FileHandler(path, encoding="utf-8")
    except OSError as e:
        raise CheckpointError(f"could not write {path}: {e.strerror or e}") from e
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    return handler


def save_step(
    out_dir: Path, step: int, write: Callable[[Path], Path], is_best: bool, keep: int
) -> Path:
    """This step's checkpoint, written by ``write(path)`` (atomically), with latest.pt (and best.pt)
    pointed at it and all but the newest ``keep`` step files removed; both trainers save this way.
    """
    path = write(out_dir / step_checkpoint_name(step))
    point_to(path, out_dir / LATEST_FILE)
    if is_best:
        point_to(path, out_dir / BEST_FILE)
    prune_checkpoints(out_dir, keep)
    return path


def overwrite_refusal(cfg: TrainConfig) -> str | None:
    """Why ``--overwrite`` may not move the earlier run in ``--output_dir`` aside, or None: it moves
    everything there, and the folder holds a file this run reads (a manifest, its audio, a shard,
    the tokenizer, the --init_from checkpoint)."""
    out = Path(cfg.output_dir)
    if not cfg.overwrite or cfg.resume or existing_run(out) is None:
        return None
    if (held := input_inside(out, run_inputs(cfg))) is None:
        return None
    return (f"--overwrite would move {held}, which this run reads, out of --output_dir {out} (it "
            "moves everything there aside); nothing was moved: give another --output_dir")


def run_inputs(cfg: TrainConfig) -> Iterator[Path]:
    """Every file and folder a training run reads: its manifests and the audio they name, its
    shards, tokenizer, --init_from checkpoint and augmentation folders."""
    for name in ("tokenizer", "init_from", "noise_dir", "rir_dir", "train_manifest",
                 "valid_manifest", "pseudo_manifest"):
        if path := getattr(cfg, name):
            yield Path(path)
    if cfg.train_shards:
        yield from shard_files(cfg.train_shards)
    mixed = [entry.path for entry in parse_mix(cfg.train_mix)] if cfg.train_mix else []
    yield from map(Path, mixed)
    for manifest in (cfg.train_manifest, cfg.valid_manifest, cfg.pseudo_manifest, *mixed):
        if manifest:
            yield from manifest_audio(manifest)
