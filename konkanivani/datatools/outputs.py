"""Where the tools write: names made from inputs, outputs that must not be an input, and results
that appear whole or not at all.

- ``check_outputs``: the one decision whether a run may write its outputs (``--output``,
  ``--report``, an export's files, a plot): none of them may be a file the run reads (every
  checkpoint, manifest and audio file, as the run expands its inputs) or another of its outputs,
  compared with symlinks followed, and each must have a folder it can be written in. Every tool
  asks it before it reads or decodes anything, so a refusal loses no work.
- ``write_output`` and ``output_file``: an output written through a temporary file beside it and
  renamed at the end, so a failed or interrupted run leaves the old file whole.
- ``safe_name``: a file name for any key (a Kaldi utterance id, a clip's relative path) that is
  unique by construction: a key that is already a plain name is kept, any other gets its unsafe
  characters replaced *and* a short hash of the whole key, so ``a/b`` and ``a_b`` stay two files
  and ``..`` or ``../x`` become ordinary names inside the folder.
- ``child``: a name given on the command line (a split name) as one file in its folder, or a
  one-line refusal.
- ``refuse_overlap``: no tool writes into its own input.
- ``Staging``: a tool builds its outputs in a hidden folder inside the output folder and
  ``publish`` moves them in at the end, the manifests last; a kill before that leaves the old
  result, and no manifest ever names audio of another build.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

from ..checkpoint import atomic_file, fsync_dir, write_file_atomic
from ..data.manifest import input_inside

__all__ = ["OutputError", "Staging", "check_outputs", "child", "output_file", "refuse_overlap",
           "safe_name", "write_output"]

# letters (any script), digits, _ . - ; not starting with a dot
_PLAIN = re.compile(r"[\w][\w.\-]*")
_MAX_NAME = 120  # characters of a kept name; longer keys are cut and hashed


class OutputError(ValueError):
    """An output that cannot be written where it was asked for (said in one line)."""


def _hash(key: str) -> str:
    return hashlib.sha1(key.encode("utf-8", "surrogatepass")).hexdigest()[:8]


def safe_name(key: str) -> str:
    """A file name (no folder) standing for ``key``: ``key`` itself when it is plain (letters,
    digits, ``_ . -``, not starting with a dot, at most 120 characters), otherwise its plain
    characters with ``_`` for the others and ``-`` and 8 hex digits of its SHA-1 appended. Two
    different keys get two different names (but for a hash collision, which callers still check)."""
    if _PLAIN.fullmatch(key) and len(key) <= _MAX_NAME:
        return key
    cleaned = re.sub(r"[^\w.\-]+", "_", key).lstrip(".")[:_MAX_NAME - 9] or "_"
    return f"{cleaned}-{_hash(key)}"


def child(folder: Path, name: str, what: str) -> Path:
    """``folder / name`` for a ``name`` the user chose (``what`` names the flag in the message);
    ``OutputError`` unless it is one plain file name that stays in ``folder``."""
    if (
        not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\0" in name
        or name.startswith(".")
    ):
        raise OutputError(
            f"{what} {name!r}: not a plain name (no folders, '.', '..' or leading dot); it names a "
            f"file in {folder}"
        )
    return folder / name


def refuse_overlap(source: Path, out: Path, source_what: str = "the source") -> None:
    """``OutputError`` when the output folder is ``source`` or contains it: a tool that wrote
    there could replace or re-read its own input."""
    src, dst = source.resolve(), out.resolve()
    if src == dst or dst in src.parents:
        how = "is" if src == dst else "contains"
        raise OutputError(
            f"output folder {out} {how} {source_what} {source}: a tool never writes into its own "
            "input; choose an output folder outside it"
        )


PathLike = str | Path
Outputs = Mapping[str, PathLike | None] | Iterable[tuple[str, PathLike | None]]


def _identity(path: PathLike) -> tuple:
    """The file ``path`` names, symlinks followed: its device and inode where it exists (a hard link
    is the same file too), else the absolute path it would be made at."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):  # missing, or a name the system refuses (a NUL byte)
        return ("path", os.path.realpath(path))
    return ("file", st.st_dev, st.st_ino)


def _unwritable(path: Path) -> str | None:
    """Why no file can be written at ``path``, or None. A missing folder is no reason: writing
    makes it (``output_file``), as long as the nearest folder that exists may be written in."""
    target = Path(os.path.realpath(path))
    if target.is_dir():
        return "is a folder; give a file name"
    folder = target.parent
    while not folder.exists():  # a path through a regular file does not exist either
        folder = folder.parent
    if not folder.is_dir():
        return f"cannot be written: {folder} is not a folder"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"cannot be written: no permission to write in {folder}"
    return None


def check_outputs(outputs: Outputs, reads: Iterable[PathLike] = (),
                  folders: Mapping[str, PathLike | None] | None = None) -> None:
    """``OutputError`` (one line naming the flag and the file) unless a run that reads ``reads`` may
    write ``outputs`` (flag and file; None: not asked for) and fill the output ``folders``:

    - no output is a file the run reads: ``reads`` holds every checkpoint, manifest and audio file,
      expanded from folders and manifests as the run expands them. Existing files are compared by
      device and inode (a symlink or a hard link to an input is that input), others by their path
      with symlinks followed;
    - no two outputs are one file (``--output X --report X``);
    - no output is a folder, and each can be written (its missing folders made);
    - no output folder is or holds a file the run reads.

    Tools ask this before they read or decode anything, so a refusal loses no work."""
    pairs = outputs.items() if isinstance(outputs, Mapping) else outputs
    given = [(flag, Path(path)) for flag, path in pairs if path is not None]
    seen: dict[tuple, tuple[str, Path]] = {}
    for flag, path in given:
        if (why := _unwritable(path)) is not None:
            raise OutputError(f"{flag} {path} {why}")
        key = _identity(path)
        if key in seen:
            other_flag, other = seen[key]
            raise OutputError(f"{other_flag} {other} and {flag} {path} are the same file: each "
                              "output needs a file of its own")
        seen[key] = (flag, path)
    reads = list(reads)
    for read in reads if seen else ():
        if (hit := seen.get(_identity(read))) is not None:
            flag, path = hit
            same = ("also an input of this command" if str(path) == str(read)
                    else f"{read}, which this command reads")
            raise OutputError(f"{flag} {path} is {same}: a tool never rewrites its own input; "
                              "write to another file")
    for flag, folder in (folders or {}).items():
        if folder is not None and (read := input_inside(folder, reads)) is not None:
            raise OutputError(f"{flag} {folder} holds {read}, which this command reads: a tool "
                              "never writes where its own input lies; choose another folder")


@contextlib.contextmanager
def output_file(path: PathLike) -> Iterator[TextIO]:
    """A UTF-8 text file to write the output ``path`` through: a temporary file beside it, renamed
    into place when the block ends and removed when it raises (a failed run, Ctrl-C), so the old
    file stays whole until the new one is complete. Missing folders are made; a symlink is written
    through, not replaced. ``OutputError`` when the file cannot be written."""
    target = Path(os.path.realpath(path))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(target) as raw:
            text = io.TextIOWrapper(raw, encoding="utf-8")
            try:
                yield text
            finally:
                # detach flushes; atomic_file then syncs, closes and renames (or removes) the file
                text.detach()
    except OSError as e:
        raise OutputError(f"could not write {path}: {e.strerror or e}") from e


def write_output(path: PathLike, text: str) -> Path:
    """Write ``text`` to the output ``path`` through ``output_file``; returns ``path``."""
    with output_file(path) as f:
        f.write(text)
    return Path(path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


class Staging:
    """A build of a tool's outputs in ``OUT/.<tool>.partial/``, laid out as they will lie in
    ``OUT``, then published. ``OUT/<record>`` (JSON) says what earlier builds wrote, so a build
    replaces exactly that and nothing a user put beside it.

    Publishing renames the old outputs into ``OUT/.<tool>.old/`` (manifests first), moves the new
    ones in (manifests last), writes the record and only then deletes the old ones: every step
    before the record is a rename, so a kill leaves the old result or, in the instant of renaming,
    no manifest rather than one naming another build's audio; the slow deletion comes after. A kill
    while building leaves the old result untouched; the next build removes the partial folders.

    ``publish`` replaces whole top-level entries (a tool that owns its folder: the demo corpus);
    ``publish_group`` replaces only the group of manifests and files an earlier build of the same
    manifests wrote, keeping other groups (``konkanivani-prepare`` run one split at a time).
    """

    def __init__(self, out: Path, tool: str, record: str):
        self.out, self.record, self.tool = out, record, tool
        self.path = out / f".{tool}.partial"
        self.trash = out / f".{tool}.old"

    def __enter__(self) -> Staging:
        self.out.mkdir(parents=True, exist_ok=True)
        # a build or a deletion that was killed: start clean
        for leftover in (self.path, self.trash):
            if leftover.exists():
                _remove(leftover)
        self.path.mkdir()
        return self

    def __exit__(self, exc_type, *exc: object) -> None:
        if self.path.exists():  # not published: an error or a kill on the way
            _remove(self.path)

    def _read(self) -> dict[str, Any]:
        try:
            record = json.loads((self.out / self.record).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return record if isinstance(record, dict) else {}

    def previous(self) -> list[str] | None:
        """The top-level names the last complete ``publish`` wrote (None when none was recorded)."""
        names = self._read().get("outputs")
        if not isinstance(names, list):
            return None
        return [
            n for n in names if isinstance(n, str) and n and "/" not in n and n not in (".", "..")
        ]

    def _set_aside(self, relative: str) -> None:
        """Rename ``OUT/relative`` into the trash (a rename: instant), if it exists."""
        source = self.out / relative
        if source.exists() or source.is_symlink():
            target = self.trash / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(source, target)

    def _move_in(self, relative: str) -> None:
        target = self.out / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.path / relative, target)

    def _finish(self, record: dict[str, Any]) -> None:
        write_file_atomic(
            self.out / self.record,
            (json.dumps(record, indent=2, ensure_ascii=False) + "\n").encode(),
        )
        fsync_dir(self.out)
        for folder in (self.path, self.trash):
            if folder.exists():
                _remove(folder)

    def publish(self, info: dict[str, Any] | None = None, stale: list[str] = ()) -> list[str]:
        """Move everything built into ``OUT``, replacing what the last build wrote (and ``stale``,
        names an unrecorded earlier build may have left); write the record (``info`` plus the
        list of outputs). Returns the names published."""
        new = sorted(p.name for p in self.path.iterdir())
        old = set(self.previous() or ()) | set(stale)
        manifests = [n for n in new if n.endswith(".jsonl")]
        self.trash.mkdir(exist_ok=True)
        self._set_aside(self.record)
        # manifests first
        for name in sorted(old | set(new), key=lambda n: not n.endswith(".jsonl")):
            self._set_aside(name)
        for name in [n for n in new if n not in manifests] + manifests:  # manifests last
            self._move_in(name)
        self._finish({**(info or {}), "outputs": new})
        return new

    def _groups(self) -> list[dict[str, Any]]:
        return [g for g in self._read().get("groups", []) if isinstance(g, dict)]

    def check_group(self, manifests: list[str], files: list[str]) -> None:
        """``OutputError`` for a file of ``files`` (relative to ``OUT``) that a build of
        ``manifests`` may not write: one another group wrote, or one that exists and no build of
        this tool wrote.
        ``publish_group`` checks this before anything moves; a tool may check it before any work."""
        groups = self._groups()
        owned = {
            f: g
            for g in groups
            if not set(g.get("manifests", [])) & set(manifests)
            for f in g.get("files", [])
        }
        ours = self.group_files(manifests)
        for relative in files:
            if relative in owned:
                raise OutputError(
                    f"{self.out / relative} belongs to {', '.join(owned[relative]['manifests'])} of"
                    " an earlier run; give this run another OUT_DIR, or run both in one"
                )
            if relative not in ours and (self.out / relative).exists():
                raise OutputError(
                    f"{self.out / relative} exists and was not written by"
                    f" konkanivani-{self.tool.replace('_', '-')}; this run would replace it: move"
                    " it away or choose another OUT_DIR"
                )

    def publish_group(self, manifests: list[str], files: list[str]) -> None:
        """Move this build's ``manifests`` (top-level names) and ``files`` (paths relative to
        ``OUT``) into ``OUT``. An earlier group that wrote any of these manifests is replaced whole;
        other groups
        stay. ``OutputError`` (before anything moves) where ``check_group`` says so."""
        self.check_group(manifests, files)
        groups = self._groups()
        replaced = [g for g in groups if set(g.get("manifests", [])) & set(manifests)]
        kept = [g for g in groups if g not in replaced]
        self.trash.mkdir(exist_ok=True)
        for g in replaced:  # manifests first, then their files
            for relative in [*g.get("manifests", []), *g.get("files", [])]:
                self._set_aside(relative)
        # a manifest of the same name that no recorded group wrote (an older version's)
        for name in manifests:
            self._set_aside(name)
        for relative in files:
            self._move_in(relative)
        for name in manifests:
            self._move_in(name)
        self._finish({"groups": [*kept, {"manifests": sorted(manifests), "files": sorted(files)}]})

    def group_files(self, manifests: list[str]) -> set[str]:
        """The files of the recorded groups that wrote any of ``manifests`` (which a build of them
        replaces)."""
        return {
            f
            for g in self._groups()
            if set(g.get("manifests", [])) & set(manifests)
            for f in g.get("files", [])
        }
