"""Writing a manifest's utterances as tar shards (``konkanivani-prepare shards``).

Every row goes through the validator's checks first (``manifest.check_row``); a row that fails is
counted by reason and named (the first few), as ``konkanivani-prepare`` does. The usable rows, in
manifest order, are dealt to shards of ``--shard_size`` utterances or ``--shard_hours`` hours; each
utterance becomes ``KEY.flac`` (its audio at 16 kHz mono, 16-bit FLAC: lossless for the 16-bit
sources people have; or with ``audio_format="opus"`` ``KEY.opus``, Opus in Ogg at about 20 kbit/s
(lossy, for a corpus that must travel small: a tenth of the bytes) and ``KEY.json`` (its
text, its duration and the row's other keys), ``KEY`` being the manifest's name and line
(``train-00000017``: line 17 of train.jsonl), so a shard's utterance leads back to its row. Then
``shards.json`` (the list: each shard's file, bytes, keys and durations) and ``text.txt`` (every
text, for a fresh run's tokenizer).

One run at a time: a run holds the folder (``hold_shard_folder``, a lock on ``.shards.lock`` there,
as a training run holds its own) while it writes, and a second one into it is refused in one line.

Safe to interrupt: each shard is written to a temporary file and renamed into place only when whole,
and the list comes last, so a killed run leaves no half shard a reader would take, and the old list
(if any) still describes only shards that are whole. A run again continues: a shard already in place
that an earlier run finished for the same rows (its list, or the progress record a killed run left)
is kept without being read, the others are written. The bytes of a shard depend only on its
utterances (member times are zero), so writing one again gives the same file.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import logging
import os
import re
import tarfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf
from tqdm import tqdm

from ..checkpoint import atomic_file, write_file_atomic
from ..config import DEFAULT_MAX_DURATION
from ..data.audio import AudioError, load_audio
from ..data.frames import SAMPLE_RATE
from ..data.manifest import ManifestError, check_row, iter_manifest
from ..data.shards import (
    AUDIO_MEMBER,
    AUDIO_MEMBERS,
    FORMAT,
    LIST_NAME,
    META_MEMBER,
    TEXTS_NAME,
    ShardError,
)
from ..data.tokenizer import Tokenizer, train_tokenizer
from .importers import print_skipped

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; the folder is then not guarded
    fcntl = None

__all__ = ["SHARD_PATTERN", "ShardReport", "write_shards", "shard_name", "print_shard_report",
           "hold_shard_folder"]

log = logging.getLogger("konkanivani")

SHARD_PATTERN = re.compile(r"shard-(\d{6})\.tar")
_EXAMPLES = 10
# the shards a run has finished, a line each, until it writes the list
PROGRESS = ".shards.progress.jsonl"
LOCK = ".shards.lock"  # held by the run writing the folder (hold_shard_folder)


def shard_name(i: int) -> str:
    return f"shard-{i:06d}.tar"


@dataclass
class ShardReport:
    out_dir: Path
    shards: int = 0
    written: int = 0  # shards written by this run (the others were in place already)
    utterances: int = 0
    seconds: float = 0.0
    total: int = 0  # manifest rows
    skipped: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    # shards of an earlier, larger run, no longer listed
    removed: list[str] = field(default_factory=list)


@dataclass
class _Row:
    key: str
    where: str
    audio: Path
    duration: float
    text: str
    extra: dict[str, Any]


def _key_stem(manifest: Path) -> str:
    """The manifest's name as a key's start: a key holds no dot (the layout splits names at the
    first)."""
    return re.sub(r"[^0-9A-Za-z_-]+", "_", manifest.stem) or "utt"


def _usable_rows(
    manifest: Path, tokenizer: Tokenizer | None, max_duration: float, report: ShardReport
) -> list[_Row]:
    entries = list(iter_manifest(manifest))
    if tokenizer is None:  # as prepare: characters, the strictest "too short for CTC"
        texts = [
            row.get("text")
            for _, row in entries
            if isinstance(row, dict) and isinstance(row.get("text"), str)
        ]
        tokenizer = train_tokenizer([t for t in texts if t.strip()] or ["a"], model_type="char")
    stem, rows = _key_stem(manifest), []
    for line_no, row in entries:
        report.total += 1
        where = f"{manifest}:{line_no}"
        if isinstance(row, ManifestError):
            reason, detail = "not a JSON object line", ""
        else:
            check = check_row(row, manifest.parent, tokenizer, max_duration=max_duration)
            if check.error is None:
                extra = {
                    k: v for k, v in row.items() if k not in ("audio_filepath", "duration", "text")
                }
                rows.append(
                    _Row(
                        f"{stem}-{line_no:08d}",
                        where,
                        check.audio_path,
                        check.duration,
                        check.text,
                        extra,
                    )
                )
                continue
            reason, detail = check.error
        report.skipped[reason] += 1
        if len(report.examples) < _EXAMPLES:
            report.examples.append(f"{where}: {reason}" + (f" ({detail})" if detail else ""))
    return rows


def _groups(rows: list[_Row], shard_size: int, shard_hours: float) -> list[list[_Row]]:
    groups: list[list[_Row]] = [[]]
    seconds = 0.0
    for row in rows:
        full = (
            len(groups[-1]) >= shard_size
            if shard_size
            else seconds + row.duration > shard_hours * 3600
        )
        if groups[-1] and full:
            groups.append([])
            seconds = 0.0
        groups[-1].append(row)
        seconds += row.duration
    return groups if groups[0] else []


def _member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, 0
    tar.addfile(info, io.BytesIO(data))


# how each audio format is written: soundfile's format, subtype and settings
AUDIO_WRITE = {"flac": dict(format="FLAC", subtype="PCM_16"),
               "opus": dict(format="OGG", subtype="OPUS", compression_level=0.95)}
assert set(AUDIO_WRITE) == set(AUDIO_MEMBERS)


def _encode(row: _Row, audio_format: str = AUDIO_MEMBER) -> tuple[bytes, float]:
    """The row's audio as 16 kHz mono bytes of ``audio_format`` (16-bit FLAC, or Opus), and its
    duration."""
    wav = load_audio(row.audio, label=row.where).numpy()
    buffer = io.BytesIO()
    # resampling overshoots
    sf.write(buffer, np.clip(wav, -1.0, 1.0), SAMPLE_RATE, **AUDIO_WRITE[audio_format])
    return buffer.getvalue(), round(len(wav) / SAMPLE_RATE, 6)


def _write_shard(path: Path, rows: list[_Row], report: ShardReport,
                 audio_format: str = AUDIO_MEMBER) -> dict[str, Any]:
    """Write one shard atomically; its list entry. A row whose audio fails now is left out,
    counted."""
    keys, durations = [], []
    with (
        atomic_file(path) as f,
        tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar,
    ):
        for row in rows:
            try:
                audio, duration = _encode(row, audio_format)
            except AudioError as e:
                report.skipped[e.reason] += 1
                if len(report.examples) < _EXAMPLES:
                    report.examples.append(f"{row.where}: {e.reason}")
                continue
            meta = {"text": row.text, "duration": duration, **row.extra}
            _member(tar, f"{row.key}.{audio_format}", audio)
            _member(
                tar,
                f"{row.key}.{META_MEMBER}",
                json.dumps(meta, ensure_ascii=False).encode("utf-8"),
            )
            keys.append(row.key)
            durations.append(duration)
    return {
        "path": path.name,
        "bytes": path.stat().st_size,
        "utterances": len(keys),
        "hours": round(sum(durations) / 3600, 6),
        "plan": _plan_digest(rows, audio_format),
        "keys": keys,
        "durations": durations,
    }


def _plan_digest(rows: list[_Row], audio_format: str = AUDIO_MEMBER) -> str:
    """What a shard should hold: its rows' keys and audio files (a changed manifest changes it), in
    which audio format (FLAC's digest is the one shards had before there was a choice)."""
    plan: list[Any] = [[row.key, str(row.audio), row.text] for row in rows]
    if audio_format != AUDIO_MEMBER:
        plan.append(audio_format)
    return hashlib.sha256(json.dumps(plan).encode()).hexdigest()[:16]


def _kept(path: Path, rows: list[_Row], done: dict[str, dict[str, Any]],
          audio_format: str = AUDIO_MEMBER) -> dict[str, Any] | None:
    """The entry of a shard in place that an earlier run wrote whole for these same rows in this
    audio format, else None."""
    entry = done.get(path.name)
    if entry is None or entry.get("plan") != _plan_digest(rows, audio_format) \
            or not path.is_file() \
            or path.stat().st_size != entry.get("bytes"):
        return None
    return entry


def write_shards(
    manifest: str | Path,
    out_dir: str | Path,
    *,
    shard_size: int = 0,
    shard_hours: float = 0.0,
    tokenizer: Tokenizer | None = None,
    max_duration: float = DEFAULT_MAX_DURATION,
    progress: bool = True,
    audio_format: str = AUDIO_MEMBER,
) -> ShardReport:
    """Write ``manifest``'s usable utterances as shards in ``out_dir`` and list them (the module's
    docstring says how), their audio as ``audio_format`` (``AUDIO_MEMBERS``). One of
    ``shard_size`` (utterances) and ``shard_hours`` is given."""
    if (shard_size > 0) == (shard_hours > 0):
        raise ValueError("give one of shard_size and shard_hours")
    if audio_format not in AUDIO_MEMBERS:
        raise ValueError(f"audio_format {audio_format!r}: want one of {', '.join(AUDIO_MEMBERS)}")
    manifest, out_dir = Path(manifest), Path(out_dir)
    report = ShardReport(out_dir)
    rows = _usable_rows(manifest, tokenizer, max_duration, report)
    groups = _groups(rows, shard_size, shard_hours)
    if not groups:
        return report
    out_dir.mkdir(parents=True, exist_ok=True)
    with hold_shard_folder(out_dir):
        _write_groups(manifest, out_dir, groups, report, progress, audio_format)
    return report


def _write_groups(manifest: Path, out_dir: Path, groups: list[list[_Row]], report: ShardReport,
                  progress: bool, audio_format: str = AUDIO_MEMBER) -> None:
    for stale in out_dir.glob(".shard-*.tar.tmp*"):  # a run killed while writing a shard
        stale.unlink(missing_ok=True)
    done = _done_before(out_dir)
    entries, texts = [], []
    for i, group in enumerate(tqdm(groups, desc="shards", unit="shard", disable=not progress)):
        path = out_dir / shard_name(i)
        entry = _kept(path, group, done, audio_format)
        if entry is None:
            entry = _write_shard(path, group, report, audio_format)
            report.written += 1
            # after the rename: the shard is whole
            with open(out_dir / PROGRESS, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry, ensure_ascii=False) + "\n")
        entries.append(entry)
        by_key = {row.key: row.text for row in group}
        texts += [by_key[key] for key in entry["keys"]]
    for old in sorted(out_dir.glob("shard-*.tar")):  # an earlier run's, past this run's count
        if (m := SHARD_PATTERN.fullmatch(old.name)) and int(m.group(1)) >= len(groups):
            old.unlink()
            report.removed.append(old.name)
    write_file_atomic(out_dir / TEXTS_NAME, "".join(f"{t}\n" for t in texts).encode("utf-8"))
    listing = {
        **FORMAT,
        "manifest": str(manifest),
        "utterances": sum(e["utterances"] for e in entries),
        "hours": round(sum(e["hours"] for e in entries), 6),
        "shards": entries,
    }
    # last
    write_file_atomic(out_dir / LIST_NAME, json.dumps(listing, ensure_ascii=False).encode("utf-8"))
    (out_dir / PROGRESS).unlink(missing_ok=True)
    report.shards = len(entries)
    report.utterances = listing["utterances"]
    report.seconds = listing["hours"] * 3600


@contextlib.contextmanager
def hold_shard_folder(out_dir: Path) -> Iterator[None]:
    """Hold ``out_dir`` (which exists) while the block writes shards in it: an exclusive lock on
    ``out_dir/.shards.lock``, which the kernel releases on any exit, kill -9 included; the file is
    removed as the block ends. ``ShardError`` in one line, naming the holder, when another run
    holds it: two runs would each delete the other's half-written shards as stale.

    ``flock`` rather than the training directory's ``lockf``: no worker is forked here, and a
    second hold in the same process is refused too (``lockf`` lets a process take its own lock)."""
    fd = _take_lock(out_dir) if fcntl is not None else None
    if fd is None:
        yield
        return
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        yield
    finally:
        (out_dir / LOCK).unlink(missing_ok=True)  # while held: see _take_lock for one waiting on it
        os.close(fd)  # releases the lock


def _take_lock(out_dir: Path) -> int | None:
    """The open, locked ``out_dir/.shards.lock``; None where the file system has no locks."""
    path = out_dir / LOCK
    for _ in range(10):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ShardError(f"cannot write to {out_dir}: {e.strerror or e}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.read(fd, 200).decode("utf-8", "replace").strip() or "a process"
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ShardError(f"{out_dir}: another konkanivani-prepare shards is writing this "
                                 f"folder ({holder}); wait for it to end, or give another "
                                 "--output_dir") from None
            log.warning("cannot lock %s (%s): a second run into it is not refused", path,
                        e.strerror or e)  # some FUSE mounts
            return None
        # Its holder removes the file as it lets go: one opened just before holds a file no longer
        # in the folder, while another run may make and lock a new one. So the one locked must be
        # the one there.
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        os.close(fd)
    raise ShardError(f"could not lock {path}: other processes keep replacing it")


def _done_before(out_dir: Path) -> dict[str, dict[str, Any]]:
    """The shards earlier runs finished: the old list's, then those a killed run recorded after
    it."""
    entries: dict[str, dict[str, Any]] = {}
    try:
        for entry in json.loads((out_dir / LIST_NAME).read_text(encoding="utf-8"))["shards"]:
            entries[entry["path"]] = entry
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        lines = (out_dir / PROGRESS).read_text(encoding="utf-8").splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            entry = json.loads(line)
            entries[entry["path"]] = entry
        except (ValueError, KeyError, TypeError):  # the last line of a run killed while appending
            continue
    return entries


def print_shard_report(report: ShardReport) -> None:
    if report.shards:
        print(
            f"wrote {report.out_dir / LIST_NAME}: {report.shards} shards ({report.written} written"
            f" now, {report.shards - report.written} already in place), {report.utterances}"
            f" utterances, {report.seconds / 3600:.2f} h"
        )
    else:
        print("no usable utterance: no shard written")
    if report.removed:
        print(f"removed {len(report.removed)} shards of an earlier run past this one's count: "
              f"{', '.join(report.removed[:5])}{' ...' if len(report.removed) > 5 else ''}")
    print_skipped(report.skipped, report.examples, report.total)
